"""The probe's child process: ``python -m kvpool.daemon.llama.cpu_probe_child features | repack MODEL``.

``features`` prints llama.cpp's system info (its compiled-in CPU features). ``repack MODEL`` loads the model with
llama.cpp's extra (repacking) buffer types and decodes a short prompt and a few single tokens, which runs the
repacked matrix kernels both ways (a batch and one row). Exit 0 means it survived; a CPU that cannot run them
kills this process, not the daemon.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvpool.daemon.engine.cpu_share import usable_cores
from kvpool.daemon.llama.model import Model, system_info

PROBE_PROMPT = "The capital of France is Paris. The capital of Italy is"


def decode_a_few_tokens(path: Path) -> None:
    model = Model(path, context_size=256, hot_slots=1, batch_size=64, threads=usable_cores(), repack=True)
    try:
        tokens = model.tokenize(PROBE_PROMPT, add_bos=True)[:48]
        model.batch.clear()
        model.batch.add(0, tokens, 0, outputs=True)
        if model.decode() != 0:
            raise RuntimeError("llama_decode refused the probe prompt")
        for step in range(3):
            model.batch.clear()
            model.batch.add(0, [tokens[step]], len(tokens) + step, outputs=True)
            if model.decode() != 0:
                raise RuntimeError("llama_decode refused a probe token")
    finally:
        model.close()


def main(argv: list[str]) -> int:
    if argv[:1] == ["features"]:
        print(system_info())
        return 0
    if len(argv) == 2 and argv[0] == "repack":
        decode_a_few_tokens(Path(argv[1]))
        return 0
    print("usage: python -m kvpool.daemon.llama.cpu_probe_child features | repack MODEL", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
