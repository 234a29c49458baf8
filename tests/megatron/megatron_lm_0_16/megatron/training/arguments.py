"""Megatron-LM 0.16's ``parse_args(extra_args_provider, ignore_unknown_args)`` over the flags the
optimizer construction reads, and its ``validate_args`` check of Muon's settings."""

import argparse

import torch


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """The command line (``sys.argv``) parsed with the flags below and ``extra_args_provider``'s."""
    parser = argparse.ArgumentParser(description="Megatron-LM 0.16 arguments (stand-in)", allow_abbrev=False)
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon", "dist_muon"])
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--min-lr", type=float, default=0.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--muon-momentum", type=float, default=0.9)
    parser.add_argument("--muon-use-nesterov", action="store_true")
    parser.add_argument("--muon-num-ns-steps", type=int, default=5)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args()[0]
    return parser.parse_args()


def validate_args(args):
    """The parameter dtype of ``--bf16``, and Megatron-LM 0.16's refusal of Muon with the distributed optimizer."""
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    if "muon" in args.optimizer:
        assert not args.use_distributed_optimizer, "Muon optimizer does not support distributed optimizer for now."
    return args
