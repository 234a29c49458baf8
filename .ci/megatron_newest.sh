#!/usr/bin/env bash
# CI job for the newest megatron-core release, next to the README install's version (.ci/run).
#
# megatron-core 0.17+ requires Python 3.12; on CI's Python 3.11 its sdist installs with
# --ignore-requires-python, plus triton (0.18+ imports it at `import megatron.core`). The venv
# lies under ~/.cache and holds only megatron-core, triton and the project (editable); it sees the
# packages of the python that runs this script (torch, hydra, ...: the README install's) behind its
# own through a .pth file naming that python's site directories. `venv --system-site-packages` would
# not do: from inside a venv it exposes the base interpreter's packages, not the active venv's, and
# torch is lost. Where that python lacks the README install (a fresh shell on a bare python), the
# venv gets it the README's way, `pip install -e ".[dev]" -c constraints.txt`: the CPU torch on
# disk, never a CUDA one. The main environment is left alone and a rerun installs nothing.
# megatron/training (shipped in the sdist since 0.17) imports typing.override, new in 3.12: a .pth
# file in the venv supplies it on 3.11. megatron-core's own Muon (TensorParallelMuon) needs NVIDIA's
# emerging-optimizers, which declares Python >= 3.12 too (on 3.11 pip offers only a placeholder
# 999.9.9): its pure-Python wheel installs pinned with --no-deps --ignore-requires-python, plus its one
# other requirement, absl-py, and runs with the same shim.
#
# Runs there the tests that megatron-core's changes between versions reach: the CPU bridge, the
# optimizer hook (stock-megatron equality, SR replicas at TP=2, dist checkpoints), build_optimizer's
# calls and parameter groups (with Muon under megatron's layer-wise distributed optimizer, whose
# config field and shard-aligned layout 0.19 added, at DP=2 and TP=2 x DP=2, and beside
# megatron-core's own Muon), our Muon against megatron-core's
# TensorParallelMuon (Newton-Schulz bit for bit, option D's steps), the Megatron-LM entry against
# megatron.training, the distributed optimizer with FP32 reduction and clipping, the layer converters
# and one app run (TP x DP). Exits non-zero if any fails, if none ran, or if the venv does not hold
# megatron-core $VERSION and a megatron-core Muon that finds emerging-optimizers $EMERGING_OPTIMIZERS.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${MEGATRON_CORE_NEWEST:-0.19.2}"
TRITON="${MEGATRON_CORE_NEWEST_TRITON:-3.9.0}"
EMERGING_OPTIMIZERS="${MEGATRON_CORE_NEWEST_EMERGING_OPTIMIZERS:-0.3.0}"
ABSL_PY="${MEGATRON_CORE_NEWEST_ABSL_PY:-2.5.1}"
HOST_PYTHON="$(command -v python3)"
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/megatron-lowprec/megatron-core-$VERSION-py$("$HOST_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
PYTHON="$VENV/bin/python"
HOST_SITES="$("$HOST_PYTHON" -c 'import site; print(repr([*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]))')"
STAMP="$VENV/host-sites"

installed_version() {
    "$PYTHON" -c 'from megatron.core import package_info; print(package_info.__version__)' 2>/dev/null || true
}

installed_emerging_optimizers() {
    "$PYTHON" -c 'from importlib.metadata import version; print(version("emerging-optimizers"))' 2>/dev/null || true
}

if [[ "$(installed_version)" != "$VERSION" || "$(cat "$STAMP" 2>/dev/null)" != "$HOST_SITES" ]]; then
    rm -rf "$VENV"
    "$HOST_PYTHON" -m venv "$VENV"
    site_packages="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; list(map(site.addsitedir, $HOST_SITES))" > "$site_packages/host_python_sites.pth"
    echo 'import typing; hasattr(typing, "override") or setattr(typing, "override", lambda method: method)' \
        > "$site_packages/typing_override_py312.pth"
    "$PYTHON" -m pip install --quiet -e ".[dev]" -c constraints.txt
    "$PYTHON" -m pip install --quiet --no-deps --ignore-requires-python --no-binary megatron-core \
        -c constraints.txt "megatron-core==$VERSION" "triton==$TRITON"
    echo "$HOST_SITES" > "$STAMP"
fi
if [[ "$(installed_emerging_optimizers)" != "$EMERGING_OPTIMIZERS" ]]; then
    "$PYTHON" -m pip install --quiet --no-deps --ignore-requires-python \
        "emerging-optimizers==$EMERGING_OPTIMIZERS" "absl-py==$ABSL_PY"
fi
if [[ "$(installed_version)" != "$VERSION" ]]; then
    echo "megatron-core newest: $VENV holds megatron-core '$(installed_version)', not $VERSION" >&2
    exit 1
fi
if ! "$PYTHON" -c 'from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS as ok; assert ok' 2>/dev/null; then
    echo "megatron-core newest: megatron-core's Muon does not find emerging-optimizers $EMERGING_OPTIMIZERS in $VENV" >&2
    exit 1
fi
echo "megatron-core $(installed_version), emerging-optimizers $(installed_emerging_optimizers), torch $("$PYTHON" -c 'import torch; print(torch.__version__)') in $VENV (behind it: $HOST_SITES)"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$VENV/inductor}"
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
status=0
# --dist worksteal (not the project's loadfile): Megatron-LM's layout tests, about half of this job's
# test time, lie in one file, which loadfile would hand to one worker whole. They run only here
# (megatron.training ships with megatron-core 0.17+): Megatron-LM's loop trains TP=2 (C), PP=2 (sr),
# TP x PP with D-BF16's remainders, PP with virtual stages (coat) and TP x DP with the distributed
# optimizer (sr, compiled), and resumes C and kahan trained at TP=2 at TP=1, coat at DP=2 at DP=1.
"$PYTHON" -m pytest -p no:cacheprovider --durations=10 --dist worksteal --junitxml="$REPORT" \
    tests/megatron/test_cpu_bridge.py \
    "tests/optim/test_muon.py::test_newton_schulz_is_megatron_cores_bit_for_bit_where_the_normalization_is_exact" \
    "tests/optim/test_muon.py::test_option_d_steps_as_megatron_cores_muon" \
    "tests/megatron/test_optimizer_hook.py::test_option_d_reproduces_stock_megatron_bf16_optimizer" \
    "tests/megatron/test_optimizer_hook.py::test_replicas_stay_bit_identical[C-2-2-False]" \
    "tests/megatron/test_optimizer_hook.py::test_dist_checkpoint_saved_at_tp2_loads_at_tp1[C]" \
    tests/megatron/test_build_optimizer.py \
    tests/megatron/test_megatron_lm.py \
    "tests/megatron/test_distributed_optimizer.py::test_sharded_states_train_bit_identically_and_hold_their_share[dp2-fp32-reduction]" \
    tests/megatron/test_layers.py \
    "tests/train/test_app.py::test_tensor_and_data_parallel_together" || status=$?
"$PYTHON" - "$REPORT" "$status" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree

cases = list(ElementTree.parse(sys.argv[1]).iter("testcase"))
ran = [case for case in cases if case.find("skipped") is None]
failed = [case for case in ran if case.find("failure") is not None or case.find("error") is not None]
print(f"megatron-core newest: {len(ran)} tests ran, {len(failed)} failed, {len(cases) - len(ran)} skipped")
if not ran or failed or sys.argv[2] != "0":
    sys.exit(f"megatron-core newest: FAILED (pytest exit status {sys.argv[2]})")
EOF
