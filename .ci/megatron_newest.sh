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
# A second venv, made the same way, holds megatron-core $OLDEST_TRAINING (0.17.1: the oldest package that
# ships megatron/training, whose setup_model_and_optimizer calls get_megatron_muon_optimizer for Muon
# where 0.18+ calls get_megatron_optimizer) and no emerging-optimizers; it runs the Megatron-LM entry's
# optimizer tests through that version's own setup_model_and_optimizer.
#
# Runs in the newest venv the tests that megatron-core's changes between versions reach: the CPU bridge, the
# optimizer hook (stock-megatron equality, SR replicas at TP=2, dist checkpoints), build_optimizer's
# calls and parameter groups (with Muon under megatron's layer-wise distributed optimizer, whose
# config field and shard-aligned layout 0.19 added, at DP=2 and TP=2 x DP=2, and beside
# megatron-core's own Muon), our Muon against megatron-core's
# TensorParallelMuon (Newton-Schulz bit for bit, option D's steps), the Megatron-LM entry against
# megatron.training, the distributed optimizer with FP32 reduction and clipping, the layer converters
# and one app run (TP x DP). Exits non-zero if any fails, if none ran in either venv, if a venv does not
# hold its megatron-core, if the newest's Muon does not find emerging-optimizers $EMERGING_OPTIMIZERS
# or if the second venv can import emerging-optimizers.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${MEGATRON_CORE_NEWEST:-0.19.2}"
OLDEST_TRAINING="${MEGATRON_CORE_OLDEST_TRAINING:-0.17.1}"
TRITON="${MEGATRON_CORE_NEWEST_TRITON:-3.9.0}"
EMERGING_OPTIMIZERS="${MEGATRON_CORE_NEWEST_EMERGING_OPTIMIZERS:-0.3.0}"
ABSL_PY="${MEGATRON_CORE_NEWEST_ABSL_PY:-2.5.1}"
HOST_PYTHON="$(command -v python3)"
HOST_PYTHON_VERSION="$("$HOST_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
HOST_SITES="$("$HOST_PYTHON" -c 'import site; print(repr([*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]))')"

venv_of() {
    echo "${XDG_CACHE_HOME:-$HOME/.cache}/megatron-lowprec/megatron-core-$1-py$HOST_PYTHON_VERSION"
}

installed_version() {
    "$(venv_of "$1")/bin/python" -c 'from megatron.core import package_info; print(package_info.__version__)' 2>/dev/null || true
}

# The venv of megatron-core $1 (see above), made anew where it holds another version or its stamp
# names other host site directories.
prepare_venv() {
    local version="$1" venv python site_packages
    venv="$(venv_of "$version")"
    python="$venv/bin/python"
    if [[ "$(installed_version "$version")" != "$version" || "$(cat "$venv/host-sites" 2>/dev/null)" != "$HOST_SITES" ]]; then
        rm -rf "$venv"
        "$HOST_PYTHON" -m venv "$venv"
        site_packages="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "import site; list(map(site.addsitedir, $HOST_SITES))" > "$site_packages/host_python_sites.pth"
        echo 'import typing; hasattr(typing, "override") or setattr(typing, "override", lambda method: method)' \
            > "$site_packages/typing_override_py312.pth"
        "$python" -m pip install --quiet -e ".[dev]" -c constraints.txt
        "$python" -m pip install --quiet --no-deps --ignore-requires-python --no-binary megatron-core \
            -c constraints.txt "megatron-core==$version" "triton==$TRITON"
        echo "$HOST_SITES" > "$venv/host-sites"
    fi
    if [[ "$(installed_version "$version")" != "$version" ]]; then
        echo "megatron-core $version: $venv holds megatron-core '$(installed_version "$version")', not $version" >&2
        exit 1
    fi
}

prepare_venv "$VERSION"
VENV="$(venv_of "$VERSION")"
PYTHON="$VENV/bin/python"

installed_emerging_optimizers() {
    "$PYTHON" -c 'from importlib.metadata import version; print(version("emerging-optimizers"))' 2>/dev/null || true
}

if [[ "$(installed_emerging_optimizers)" != "$EMERGING_OPTIMIZERS" ]]; then
    "$PYTHON" -m pip install --quiet --no-deps --ignore-requires-python \
        "emerging-optimizers==$EMERGING_OPTIMIZERS" "absl-py==$ABSL_PY"
fi
if ! "$PYTHON" -c 'from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS as ok; assert ok' 2>/dev/null; then
    echo "megatron-core newest: megatron-core's Muon does not find emerging-optimizers $EMERGING_OPTIMIZERS in $VENV" >&2
    exit 1
fi
echo "megatron-core $(installed_version "$VERSION"), emerging-optimizers $(installed_emerging_optimizers), torch $("$PYTHON" -c 'import torch; print(torch.__version__)') in $VENV (behind it: $HOST_SITES)"

prepare_venv "$OLDEST_TRAINING"
OLDEST_PYTHON="$(venv_of "$OLDEST_TRAINING")/bin/python"
if "$OLDEST_PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("emerging_optimizers") is None)'; then
    echo "megatron-core $OLDEST_TRAINING: emerging-optimizers is importable in $(venv_of "$OLDEST_TRAINING"), which must show that the entry's Muon does without it" >&2
    exit 1
fi
echo "megatron-core $(installed_version "$OLDEST_TRAINING") without emerging-optimizers in $(venv_of "$OLDEST_TRAINING")"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$VENV/inductor}"
REPORT="$(mktemp)"
OLDEST_REPORT="$(mktemp)"
trap 'rm -f "$REPORT" "$OLDEST_REPORT"' EXIT
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
    tests/megatron/test_megatron_lm_exit_signal.py \
    "tests/megatron/test_distributed_optimizer.py::test_sharded_states_train_bit_identically_and_hold_their_share[dp2-fp32-reduction]" \
    tests/megatron/test_layers.py \
    tests/megatron/test_megatron_lm_call_pattern.py \
    "tests/train/test_app.py::test_tensor_and_data_parallel_together" || status=$?
# megatron-core $OLDEST_TRAINING, the oldest package that ships Megatron-LM's megatron.training, whose
# setup_model_and_optimizer builds Muon through get_megatron_muon_optimizer (from 0.18 through
# get_megatron_optimizer, as above): the entry's optimizers through that code, at DP=1, TP=2 and DP=2
# (dist_muon), without emerging-optimizers, and its one-line refusal of Muon with --use-distributed-optimizer.
"$OLDEST_PYTHON" -m pytest -p no:cacheprovider -n 0 --junitxml="$OLDEST_REPORT" \
    "tests/megatron/test_megatron_lm.py::test_megatron_lms_setup_builds_the_option" \
    "tests/megatron/test_megatron_lm.py::test_dist_muon_is_the_layer_wise_muon_of_the_option" \
    tests/megatron/test_megatron_lm_call_pattern.py || status=$?
"$PYTHON" - "$status" "newest:$REPORT" "$OLDEST_TRAINING:$OLDEST_REPORT" <<'EOF'
import sys
import xml.etree.ElementTree as ElementTree

broken = False
for version, report in (argument.split(":", 1) for argument in sys.argv[2:]):
    cases = list(ElementTree.parse(report).iter("testcase"))
    ran = [case for case in cases if case.find("skipped") is None]
    failed = [case for case in ran if case.find("failure") is not None or case.find("error") is not None]
    print(f"megatron-core {version}: {len(ran)} tests ran, {len(failed)} failed, {len(cases) - len(ran)} skipped")
    broken = broken or not ran or bool(failed)
if broken or sys.argv[1] != "0":
    sys.exit(f"megatron-core newest and {sys.argv[3].split(':')[0]}: FAILED (pytest exit status {sys.argv[1]})")
EOF
