#!/usr/bin/env bash
# Build the C doubles of libnvidia-ml.so and libdcmi.so and run their own self-checks
# (smoke.c dlopens each library and exercises every call the agent makes). CI runs it:
# a broken double would otherwise only show as confusing agent test failures.
set -euo pipefail
cd "$(dirname "$0")/../tests/fixtures"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
cc="${CC:-cc}"
"$cc" -shared -fPIC -O1 -Wall -Wextra -o "$out/libnvidia-ml.so" nvml/fake_nvml.c -lpthread
"$cc" -Wall -o "$out/smoke-nvml" nvml/smoke.c -ldl -lpthread
"$out/smoke-nvml" "$out/libnvidia-ml.so"
"$cc" -shared -fPIC -O1 -Wall -Wextra -o "$out/libdcmi.so" dcmi/fake_dcmi.c -lpthread
"$cc" -Wall -Wextra -O1 -o "$out/smoke-dcmi" dcmi/smoke.c -ldl
"$out/smoke-dcmi" "$out/libdcmi.so"
