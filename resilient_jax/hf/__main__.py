"""Hugging Face Llama directories in and out.

    python -m resilient_jax.hf export --workdir=RUN --output=HF_DIR [--dtype=bfloat16]
    python -m resilient_jax.hf config --hf_dir=HF_DIR [--json]

`export` writes the newest verified checkpoint of a run. A run starts from HF_DIR with one flag,
which sets the model's shapes and tokenizer from the directory (`hf.importer.configure`):

    python launch/train.py --config=configs/tiny_cpu.py --workdir=RUN \
        --config.checkpoint.init_from_hf=HF_DIR

`config` shows what that flag sets (the model section, the tokenizer if the directory has one,
and `checkpoint.init_from_hf`), once the weights are checked against config.json: a directory
whose weights differ prints nothing and exits 2.

Exit status: 0 done, 2 bad input (one line on stderr naming the problem).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from resilient_jax.config import BadInput
from resilient_jax.contracts.exit_codes import ExitCode


def _overrides(hf_dir: str) -> dict[str, object]:
    from resilient_jax.hf.hf_config import TOKENIZER_FILE
    from resilient_jax.hf.importer import derived_model_section

    hf_dir = os.path.abspath(hf_dir)
    out: dict[str, object] = {f"model.{k}": v for k, v in derived_model_section(hf_dir).items()}
    tokenizer = os.path.join(hf_dir, TOKENIZER_FILE)
    if os.path.isfile(tokenizer):
        out["data.tokenizer"] = tokenizer
    out["checkpoint.init_from_hf"] = hf_dir
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resilient_jax.hf")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a run's newest checkpoint as HF Llama")
    export.add_argument("--workdir", required=True, help="the run directory")
    export.add_argument("--output", required=True, help="a new (or empty) directory")
    export.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    derive = commands.add_parser("config", help="the config overrides that import an HF Llama")
    derive.add_argument("--hf_dir", required=True, help="a Hugging Face Llama directory")
    derive.add_argument("--json", action="store_true", help="one JSON object instead of flags")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            from resilient_jax.hf.exporter import export as run_export

            print(run_export(args.workdir, args.output, args.dtype))
        else:
            overrides = _overrides(args.hf_dir)
            if args.json:
                print(json.dumps(overrides, indent=2))
            else:
                print("\n".join(f"--config.{k}={v}" for k, v in overrides.items()))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
