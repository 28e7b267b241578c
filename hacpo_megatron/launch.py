"""Start the main job on this machine: check the config and every input, then hand over to torchrun.

    hacpo-megatron [--config FILE] [--set KEY=VALUE ...] [--output-dir DIR] [--resume] [...]

(the installed console script; `python -m hacpo_megatron.launch` and `make run` run the same.) A mistake in the
config or in what it names (data files, tokenizer or model folders, the checkpoint to resume) is printed as one line
and exits with code 2 within seconds, before torchrun, process groups, models or Ray exist. Otherwise the process
becomes torchrun (`os.execv`, so signals reach torchrun directly and from it every rank) with as many ranks as the
config's agents need. On a cluster, call torchrun yourself (README); the ranks make the same checks.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import List, Optional

# configs/default.yaml, shipped inside the package (a link in the checkout, a copy in a wheel): an installed
# `hacpo-megatron` with no --config runs it from any folder
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.yaml")
ENTRY_MODULE = "hacpo_megatron.entry"  # the package's own torchrun program


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The main job's command line (the same for this launcher and for the entry under torchrun)."""
    parser = argparse.ArgumentParser(
        description="HACPO training of several Megatron-core agents",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""run.mode (--set run.mode=MODE), to run, time and fix rollout and training apart:
  train          the algorithm (default); --save-rollouts DIR also keeps every step's answers and rewards
  rollout_only   engines and rewards only, no learner (the initial weights throughout, no checkpoint);
                 with --save-rollouts DIR its answers, engine log-probs and rewards, per step and agent
  train_only     no engine and no Ray: train on the steps saved in --load-rollouts DIR, e.g. to replay a bad
                 step (saved by a run with the same data, seed and batch sizes: checked); no held-out evaluation""")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="YAML config (default: configs/default.yaml, shipped in the package)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set algorithm.alpha=3")
    parser.add_argument("--output-dir", default=None, help="run folder (default: runs/<run.name>)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest intact checkpoint")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--check-weights", action="store_true", help="verify engine weights after every sync")
    parser.add_argument("--save-rollouts", default=None, metavar="DIR",
                        help="write every step's answers, engine log-probs and rewards, per agent, into DIR "
                             "(run.mode train or rollout_only)")
    parser.add_argument("--load-rollouts", default=None, metavar="DIR",
                        help="run.mode train_only: train on the steps saved in DIR, with no engine and no Ray")
    parser.add_argument("--entry", default=None, metavar="FILE",
                        help="the program torchrun runs on every rank (default: the package's, hacpo_megatron.entry): "
                             "a script of yours that calls hacpo_megatron.entry.main with your own model provider, "
                             "e.g. examples/hacpo_pretrain_style.py")
    return parser.parse_args(argv)


def output_dir_of(args: argparse.Namespace, cfg) -> str:
    return args.output_dir or cfg.run.output_dir or os.path.join("runs", cfg.run.name)


def torchrun_command(nproc: int, entry_args: List[str], entry: Optional[str] = None) -> List[str]:
    """torchrun for one machine: `nproc` ranks, a static rendezvous at 127.0.0.1 on a free port, each running
    `entry` (a script) or the package's own program.

    Not `--standalone`: its c10d rendezvous keeps pickled state in a store that listens on every
    interface and unpickles it on every heartbeat (docs/security.md). The static store holds no
    pickles, but torch's TCPStore still listens on every interface whatever address it is given.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
            *([entry] if entry else ["-m", ENTRY_MODULE]), *entry_args]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from hacpo_megatron.config import ConfigError, load_config
    from hacpo_megatron.training.preflight import INPUT_ERROR_EXIT_CODE, InputError, check_inputs

    try:
        cfg = load_config(args.config, args.overrides)
        check_inputs(cfg, output_dir=output_dir_of(args, cfg), resume=args.resume, save_rollouts=args.save_rollouts,
                     load_rollouts=args.load_rollouts)
    except (ConfigError, InputError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return INPUT_ERROR_EXIT_CODE
    from hacpo_megatron.parallel.layout import required_world_size

    if args.entry and not os.path.isfile(args.entry):
        print(f"error: --entry {args.entry}: no such file", file=sys.stderr, flush=True)
        return INPUT_ERROR_EXIT_CODE
    command = torchrun_command(required_world_size(cfg.agents), argv, args.entry)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's connections stay on loopback
    # torchrun's wait, after a SIGTERM, for the ranks to finish their step and save (run.stop_grace_s); the
    # variable, not --shutdown-timeout, which older torch releases do not know
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(cfg.run.stop_grace_s)
    if cfg.run.device == "cpu":  # the ranks, Ray's actors and the reward's workers see no GPU (run.device)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
