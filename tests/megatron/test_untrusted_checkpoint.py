"""A checkpoint never runs code: the optimizer's per-rank state file (Megatron-LM's ``--ckpt-format
torch`` with the layer-wise optimizer) is unpickled with ``weights_only=True``."""
import os
import pickle

import pytest
import torch

from megatron_lowprec.megatron.optimizer import load_tensors_only


class _RunsACommand:
    """What a crafted checkpoint holds: an object whose unpickling calls ``os.system``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_crafted_pickle_is_refused_in_one_line_before_it_runs(tmp_path, protocol):
    marker = tmp_path / "ran"
    path = tmp_path / "layer_wise_optimizer_0.pt"
    with open(path, "wb") as file:
        pickle.dump({"state": {0: _RunsACommand(marker)}}, file, protocol=protocol)
    with pytest.raises(ValueError) as refused:
        load_tensors_only(str(path))
    message = str(refused.value)
    assert message.startswith(f"{path}: refused to unpickle it") and "\n" not in message
    assert not marker.exists()


def test_a_state_dict_of_tensors_and_plain_containers_loads(tmp_path):
    state = {"state": {0: {"exp_avg": torch.arange(4.0).bfloat16(), "step": 3}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    loaded = load_tensors_only(str(path))
    assert torch.equal(loaded["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert loaded["param_groups"] == state["param_groups"]
