"""Validate a config and print it resolved: python -m hacpo_megatron.config --config FILE [--set K=V ...]

--reference [FILE] writes the configuration reference generated from the schema (default: docs/config.md).
--engines prints the rollout engines the resolved config starts, one a line (`make run` installs vLLM by it);
it ignores the launcher's other arguments, so `make run`'s ARGS pass through whole."""
import argparse
import sys

import yaml

from hacpo_megatron.config.loader import ConfigError, config_to_dict, load_config


def used_engines(cfg) -> list:
    """The engine kinds the config's agents sample with, sorted; none in run.mode train_only (no engine starts)."""
    return [] if cfg.run.mode == "train_only" else sorted({agent.engine for agent in cfg.agents})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=None, help="YAML file (default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any key, e.g. --set algorithm.alpha=3 --set agents.0.parallel.tensor=2")
    parser.add_argument("--print-world-size", action="store_true",
                        help="print only the number of processes the config needs (for torchrun --nproc_per_node)")
    parser.add_argument("--reference", nargs="?", const="", default=None, metavar="FILE",
                        help="write the configuration reference (every key, type, default and what it does) "
                             "generated from the schema to FILE (default: docs/config.md), and exit")
    parser.add_argument("--engines", action="store_true",
                        help="print only the rollout engines the resolved config starts (embedded, sglang, vllm), "
                             "one a line; the launcher's other arguments (--output-dir, --resume, ...) are ignored")
    args, unknown = parser.parse_known_args(argv)
    if unknown and not args.engines:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.reference is not None:
        from hacpo_megatron.config.reference import DEFAULT_OUTPUT, write

        print(f"wrote {write(args.reference or DEFAULT_OUTPUT)}")
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_world_size:
        from hacpo_megatron.parallel.layout import required_world_size

        print(required_world_size(cfg.agents))
        return 0
    if args.engines:
        for kind in used_engines(cfg):
            print(kind)
        return 0
    yaml.safe_dump(config_to_dict(cfg), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
