#!/usr/bin/env bash
# Show that rlproxy's GPU set resolves for Linux x86-64 (CUDA wheels), without installing it:
# pip's resolver runs against PyPI's wheel metadata for manylinux x86-64 / CPython 3.11 and
# writes a report; the versions that matter are printed. Outside the test suite (it talks to
# PyPI; pip fetches metadata, and a whole wheel only where PyPI serves no metadata file).
#
#   bash deploy/resolve-gpu.sh                 # the pins of pyproject.toml's [gpu] + [train] extras
#   bash deploy/resolve-gpu.sh 'vllm==X' ...   # try another set
#   STAND_IN="llguidance==1.7.0" bash deploy/resolve-gpu.sh   # only for an index missing a dependency
#
# The default run (PyPI, no STAND_IN) resolves the whole set, torch's CUDA libraries included.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/rlproxy-resolve.XXXXXX)"
trap 'rm -rf "$work"' EXIT
if [ "$#" -gt 0 ]; then
  reqs=("$@")
else
  # the extras' requirement strings, read from pyproject.toml (the CPU torch pin is in [cpu])
  mapfile -t reqs < <(python - "$here/pyproject.toml" <<'PY'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
for name in ("train", "gpu"):
    print("\n".join(extras[name]))
PY
)
fi
extra=()
if [ -n "${STAND_IN:-}" ]; then
  # An index that lacks a dependency (a mirror's snapshot) can still check the rest of the set:
  # STAND_IN="name==version ..." adds empty wheels of exactly those, said loudly below.
  mkdir -p "$work/stubs"
  python - "$work/stubs" $STAND_IN <<'PY'
import base64, hashlib, sys, zipfile
for spec in sys.argv[2:]:
    name, version = spec.split("==")
    stem = name.replace("-", "_")  # a wheel's file and dist-info names use underscores
    dist = f"{stem}-{version}.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: rlproxy-stand-in\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},{len(t)}\n"
                     for p, t in files.items()) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(f"{sys.argv[1]}/{stem}-{version}-py3-none-any.whl", "w") as z:
        for p, t in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(p, t)
PY
  echo "STAND-INS (this index lacks them; their own dependencies are not checked): $STAND_IN"
  extra=(--find-links "$work/stubs")
fi
printf 'resolving for manylinux x86-64, CPython 3.11:\n'; printf '  %s\n' "${reqs[@]}"
# What a GPU machine gets from PyPI: this machine's pip configuration (local wheel dirs,
# constraint files, a CPU torch) is left out, unless RESOLVE_LOCAL_CONFIG=1.
isolate=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null)
[ "${RESOLVE_LOCAL_CONFIG:-0}" = 1 ] && isolate=(env)
# Every glibc a manylinux wheel may name, newest first: with --platform, pip takes each
# manylinux_2_X tag literally and does not widen it to older glibc versions (only manylinux2014
# and manylinux2010 get their older aliases), so a list with gaps misses wheels that exist, e.g.
# nvidia-nccl-cu13 2.28.3-2.31.2 (manylinux_2_18 only) and nvidia-cuda-cupti 13.0.85
# (manylinux_2_25 only). manylinux2014 = 2_17, manylinux2010 = 2_12, manylinux1 = 2_5.
platforms=()
for v in $(seq 35 -1 5); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
            --platform linux_x86_64)
"${isolate[@]}" pip install "${extra[@]}" --dry-run --quiet --ignore-installed --report "$work/report.json" \
  "${platforms[@]}" --python-version 3.11 --implementation cp --only-binary=:all: \
  --target "$work/target" "${reqs[@]}"
python - "$work/report.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
def key(item):
    return item["metadata"]["name"].lower().replace("_", "-")
versions = {key(item): item["metadata"]["version"] for item in report["install"]}
urls = {key(item): item["download_info"]["url"] for item in report["install"]}
keys = ("vllm", "unsloth", "unsloth-zoo", "torch", "transformers", "peft", "trl", "bitsandbytes",
        "xformers", "triton", "flashinfer-python", "accelerate")
print(f"resolved {len(versions)} distributions; the ones that matter:")
for name in keys:
    if name in versions:
        print(f"  {name}=={versions[name]}")
if "torch" in urls:
    print(f"  torch wheel: {urls['torch'].rsplit('/', 1)[-1]}")
# torch's CUDA libraries (a CPU-only torch pulls none); the CUDA runtime's version is torch's CUDA
runtime = next((f"{k}=={v}" for k, v in versions.items() if k.startswith("nvidia-cuda-runtime")), None)
print(f"  torch's CUDA: {'.'.join(runtime.split('==')[1].split('.')[:2]) + ' (' + runtime + ')' if runtime else 'none'}")
cuda = sorted(f"{k}=={v}" for k, v in versions.items() if k.startswith("nvidia-"))
print(f"  CUDA libraries ({len(cuda)}):")
for line in cuda or ["none"]:
    print(f"    {line}")
PY
