"""How many of pdx's tokens make one of the simulated engine's, per prompt.

For the first N requests of a Mooncake trace, builds each prompt as the
replay does (replay.Scale.Prompt: one text block per hash id, each
starting "<id>", cut to the scaled input length), then counts it:

- pdx: the bytes of the chat request's "messages" JSON over 4, as
  encoding/json writes it (it escapes < and > as \\u003c and \\u003e);
- the engine: "user: " + prompt + "\\n" over 4, rounded up
  (enginesim.ChatPromptText, promptTokens).

It prints the mean and median of each prompt's ratio and the ratio of
the sums. Usage: python3 ratio.py TRACE [N] [TOKEN_SCALE]
"""
import json
import math
import sys


def main(path, n=1000, scale=16):
    block_bytes = 512 * 4 // scale
    ratios, ours, theirs = [], 0, 0
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            r = json.loads(line)
            size = max(1, (r["input_length"] + scale - 1) // scale) * 4
            text = ""
            for h in r["hash_ids"]:
                if len(text) >= size:
                    break
                # The block's words do not change its counts: letters and
                # spaces are a byte each in both.
                text += ("<%d>" % h + "x" * block_bytes)[:block_bytes]
            text = text[:size]
            body = json.dumps([{"content": text, "role": "user"}], separators=(",", ":"))
            body = body.replace("<", "\\u003c").replace(">", "\\u003e")
            p, e = len(body) // 4, max(1, math.ceil(len("user: " + text + "\n") / 4))
            ratios.append(p / e)
            ours, theirs = ours + p, theirs + e
    ratios.sort()
    print("%s, first %d: each prompt's ratio: mean %.3f, median %.3f; the sums' ratio %.3f"
          % (path.rsplit("/", 1)[-1], len(ratios), sum(ratios) / len(ratios), ratios[len(ratios) // 2], ours / theirs))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
