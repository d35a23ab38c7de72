"""``nbtrain`` on the command line.

    $ nbtrain profile llama-70b --batch 1 --seq 4096          # table of layers, FLOPs and memory
    $ nbtrain profile gpt2 --json                             # the same as JSON
    $ nbtrain profile mypkg.models:build --measure            # time the layers on this machine too
    $ nbtrain cluster H100 --gpus 16                          # a cluster from the device catalog
    $ nbtrain cluster --detect                                # measure this machine

Errors a user can cause print one line, ``nbtrain: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from nbtrain.errors import NbtrainError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbtrain", description="Plan and run hybrid-parallel PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("profile", help="layers, parameters, FLOPs and activation memory of a model",
                       description="Profile a model on fake tensors (nothing is allocated) and print its layers.")
    p.add_argument("model", help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b, llama-13b, "
                                 "llama-70b, gpt-tiny, llama-tiny) or 'package.module:attribute'")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=_positive_int, default=None,
                   help="tokens per sequence (default: the model's context length, at most 1024)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="parameter dtype (bf16)")
    p.add_argument("--measure", nargs="?", const=True, default=False, metavar="DEVICE",
                   help="also time each layer for real (on DEVICE, default cuda if present else cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_profile)

    c = sub.add_parser("cluster", help="describe a cluster from the device catalog, or measure this machine")
    c.add_argument("device", nargs="?", default=None, help="catalog name (H100, A100-80GB, ...); omit with --detect")
    c.add_argument("--gpus", type=_positive_int, default=1, help="number of devices (default 1)")
    c.add_argument("--gpus-per-node", type=_positive_int, default=None, help="devices per node (default ≤ 8)")
    c.add_argument("--detect", action="store_true", help="describe this machine, measured by micro-benchmarks")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.set_defaults(run=_cluster)
    return parser


def _profile(args) -> None:
    from nbtrain.profiler.model import profile

    result = profile(args.model, batch_size=args.batch, seq_len=args.seq, dtype=args.dtype, measure=args.measure)
    print(result.to_json() if args.json else result)


def _cluster(args) -> None:
    from nbtrain.profiler.hardware import Cluster

    if args.detect:
        cluster = Cluster.detect(calibrate=True)
    elif args.device:
        cluster = Cluster.from_catalog(args.device, num_devices=args.gpus, devices_per_node=args.gpus_per_node)
    else:
        raise NbtrainError("name a device from the catalog (e.g. 'nbtrain cluster H100 --gpus 8') or pass --detect")
    print(json.dumps(cluster.to_dict(), indent=2) if args.json else cluster)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except NbtrainError as exc:
        print(f"nbtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nbtrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
