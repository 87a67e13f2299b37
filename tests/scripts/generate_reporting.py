"""Run one `distill generate` config and print a line per finished conversation, for kill tests.

Usage: python generate_reporting.py CONFIG_JSON
Prints ``FINISHED`` (flushed) each time a conversation is in the journal, then ``DONE``.
"""

import json
import sys


def main(config: str) -> None:
    from distill.generate import GenerateConfig, Generator

    def progress(conversations, tokens, total=None):
        for _ in range(conversations):
            print("FINISHED", flush=True)

    Generator(GenerateConfig.from_dict(json.loads(config)), progress=progress).run()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
