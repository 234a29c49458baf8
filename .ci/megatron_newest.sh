#!/usr/bin/env bash
# CI job for the newest megatron-core release, next to the README install's version (.ci/run).
#
# megatron-core 0.17+ requires Python 3.12; on CI's Python 3.11 its sdist installs with
# --ignore-requires-python, plus triton (0.18+ imports it at `import megatron.core`). The venv
# lies under ~/.cache, reuses the main environment's packages (torch, hydra, ...) through
# --system-site-packages and holds only megatron-core and triton, so the main environment is left
# alone and a rerun installs nothing. megatron/training (shipped in the sdist since 0.17) imports
# typing.override, new in 3.12: a .pth file in the venv supplies it on 3.11.
#
# Runs there the tests that megatron-core's changes between versions reach: the CPU bridge, the
# optimizer hook (stock-megatron equality, SR replicas at TP=2, dist checkpoints), build_optimizer's
# calls and parameter groups, the Megatron-LM entry against megatron.training, the distributed
# optimizer with FP32 reduction and clipping, the layer converters and one app run (TP x DP). Exits
# non-zero if any fails or if none ran.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${MEGATRON_CORE_NEWEST:-0.19.2}"
TRITON="${MEGATRON_CORE_NEWEST_TRITON:-3.9.0}"
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/megatron-lowprec/megatron-core-$VERSION-py$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
PYTHON="$VENV/bin/python"

installed_version() {
    "$PYTHON" -c 'from megatron.core import package_info; print(package_info.__version__)' 2>/dev/null || true
}

if [[ "$(installed_version)" != "$VERSION" ]]; then
    rm -rf "$VENV"
    python3 -m venv --system-site-packages "$VENV"
    "$PYTHON" -m pip install --quiet --no-deps --ignore-requires-python --no-binary megatron-core \
        "megatron-core==$VERSION" "triton==$TRITON"
    site_packages="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo 'import typing; hasattr(typing, "override") or setattr(typing, "override", lambda method: method)' \
        > "$site_packages/typing_override_py312.pth"
fi
echo "megatron-core $(installed_version) in $VENV"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$VENV/inductor}"
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
"$PYTHON" -m pytest -p no:cacheprovider --durations=10 --junitxml="$REPORT" \
    tests/megatron/test_cpu_bridge.py \
    "tests/megatron/test_optimizer_hook.py::test_option_d_reproduces_stock_megatron_bf16_optimizer" \
    "tests/megatron/test_optimizer_hook.py::test_replicas_stay_bit_identical[C-2-2-False]" \
    "tests/megatron/test_optimizer_hook.py::test_dist_checkpoint_saved_at_tp2_loads_at_tp1[C]" \
    tests/megatron/test_build_optimizer.py \
    tests/megatron/test_megatron_lm.py \
    "tests/megatron/test_distributed_optimizer.py::test_sharded_states_train_bit_identically_and_hold_their_share[dp2-fp32-reduction]" \
    tests/megatron/test_layers.py \
    "tests/train/test_app.py::test_tensor_and_data_parallel_together"
"$PYTHON" - "$REPORT" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree

cases = list(ElementTree.parse(sys.argv[1]).iter("testcase"))
ran = [case for case in cases if case.find("skipped") is None]
if not ran:
    sys.exit(f"megatron-core newest: none of the {len(cases)} collected tests ran")
print(f"megatron-core newest: {len(ran)} tests ran")
EOF
