"""Does a heuristic of the goodput policy pay its rent? The policy beside variants of its
`GoodputConfig`, in one `draftwise bench` run (the same requests, configs time-sliced together).

    .venv/bin/python benchmarks/policy_ab.py --variant lean:first_look=1024,look_much_later=2 -- \\
        --workload code-easy,code-hard,grounded \\
        --configs none,draft:k=4,draft:k=4:copy=2,draft:k=4:policy=goodput,draft:k=4:policy=goodput-lean \\
        --concurrency 1,2,4,8,16,32 --output-len 128 --num-requests 64 --threads 2 --repeats 3 --time-slice 50

Each `--variant NAME:FIELD=VALUE,...` registers the policies `goodput-NAME` and `dspark-NAME`:
`GoodputPolicy` and `DSparkPolicy` with those fields of `GoodputConfig` changed. Everything after
`--` is `draftwise bench`'s arguments; name the variants in `--configs`. The report's "over
max(none, fixed)" table then gives each variant's ratio beside the policy's and beside the A/A
copy's (the noise floor): a heuristic whose removal stays within that noise does not pay.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from draftwise.cli.main import main as draftwise_main
from draftwise.policies import register_policy
from draftwise.policies.dspark import DSparkPolicy
from draftwise.policies.goodput import GoodputConfig, GoodputPolicy


def _value(field: dataclasses.Field, text: str):
    if field.type in ("bool", bool):
        if text not in ("0", "1", "true", "false"):
            raise ValueError(f"{field.name} takes true or false, not {text!r}")
        return text in ("1", "true")
    return (int if field.type in ("int", int) else float)(text)


def variant_config(spec: str) -> tuple[str, GoodputConfig]:
    """'lean:first_look=1024,burst=1' -> ('lean', GoodputConfig(first_look=1024, burst=1))."""
    name, _, assignments = spec.partition(":")
    if not name or not assignments:
        raise ValueError(f"--variant looks like NAME:FIELD=VALUE,...; got {spec!r}")
    fields = {f.name: f for f in dataclasses.fields(GoodputConfig)}
    changes = {}
    for a in assignments.split(","):
        key, sep, val = a.partition("=")
        if key not in fields or not sep:
            raise ValueError(f"--variant {name}: {key!r} is not a GoodputConfig field ({', '.join(fields)})")
        changes[key] = _value(fields[key], val)
    return name, dataclasses.replace(GoodputConfig(), **changes)


def register_variant(name: str, config: GoodputConfig) -> str:
    """Registers `goodput-NAME` and `dspark-NAME` (the dspark policy plans with the same config)."""
    for base, prefix in ((GoodputPolicy, "goodput"), (DSparkPolicy, "dspark")):
        class Variant(base):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("config", config)
                super().__init__(*args, **kwargs)

        Variant.__name__ = f"{base.__name__}_{name}"
        register_policy(f"{prefix}-{name}")(Variant)
    return f"goodput-{name}, dspark-{name}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, bench = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,... (repeatable)")
    args = ap.parse_args(own)
    for spec in args.variant:
        try:
            name, config = variant_config(spec)
        except ValueError as e:
            print(f"policy_ab: error: {e}", file=sys.stderr)
            return 2
        print(f"policy {register_variant(name, config)}: "
              + ", ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
                          if getattr(config, f.name) != getattr(GoodputConfig(), f.name)), file=sys.stderr)
    return draftwise_main(["bench", *bench])


if __name__ == "__main__":
    sys.exit(main())
