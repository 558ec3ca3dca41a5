"""A text corpus in Parquet larger than the memory it is tokenised in: the peak resident memory of
building its token cache, and the progress lines the build logs.

    python docs/measured/parquet_memory.py --out=/tmp/parquet-memory --gb=2

Writes a `corpus.parquet` of `--gb` GB (a `text` column of 2 KB documents of words, row
groups of 10,000 rows, 20 MB of text each; dataset writers make them a few MB to a few
hundred), then builds its token cache under the byte tokenizer in a fresh process
(`mptrain.data.tokenize` through `mptrain.data.tables`, a record batch at a time) and reads
that process's peak memory: its own (`RssAnon`, sampled every 50 ms) and its resident peak
with the pages of the files it memory-maps (`ru_maxrss`), which the kernel reclaims at will.
Prints the progress lines and a table, and writes `result.json`. Needs the extra
`mptrain[data]` (pyarrow). Measured 2026-12-07: the figure in docs/models-and-data.md.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROWS_PER_GROUP, DOC_BYTES = 10_000, 2_000

BUILD = """
import json, sys, time
from absl import logging
logging.set_verbosity(logging.INFO)
from mptrain.data import token_cache, tokenize
corpus = tokenize.create_corpus((sys.argv[1],), "bytes", None, sys.argv[2])
start = time.perf_counter()
tokens = token_cache.tokens(corpus)
print(json.dumps({"tokens": int(tokens.size), "seconds": time.perf_counter() - start}))
"""


def write_corpus(path: Path, gb: float) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    # 64 MB of words drawn from a vocabulary of 50,000, Zipf-like; each document a slice of it
    # at a random offset (compressed, about as much as English text: the file's size is told)
    vocab = [f"{chr(97 + k % 26)}{k:x}" for k in range(50_000)]
    ranks = np.minimum(rng.zipf(1.2, 12_000_000), 50_000) - 1
    pool = " ".join(vocab[k] for k in ranks).encode()[: 64 << 20]
    schema = pa.schema([("text", pa.string())])
    written = 0
    with pq.ParquetWriter(path, schema) as out:
        while os.path.getsize(path) < gb * 1e9:
            starts = rng.integers(0, len(pool) - DOC_BYTES, ROWS_PER_GROUP)
            docs = [pool[k : k + DOC_BYTES].decode("ascii") for k in starts]
            out.write_table(pa.table({"text": docs}, schema=schema))
            written += DOC_BYTES * ROWS_PER_GROUP
    return written


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/parquet-memory")
    parser.add_argument("--gb", type=float, default=2.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.parquet"
    start = time.perf_counter()
    text_bytes = write_corpus(corpus, args.gb)
    print(
        f"wrote {text_bytes / 1e9:.2f} GB of text in {time.perf_counter() - start:.0f} s: {corpus}"
    )
    argv = [sys.executable, "-c", BUILD, str(corpus), str(out / "cache")]
    logs = out / "build.log"
    with open(logs, "w") as err:
        build = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        anon = 0  # the process's own memory (RssAnon), sampled: not the file pages it maps
        while build.poll() is None:
            anon = max(anon, _rss_anon(build.pid))
            time.sleep(0.05)
        stdout = build.stdout.read()
    stderr = logs.read_text()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KB on Linux
    progress = [line for line in stderr.splitlines() if "data: " in line]
    for line in progress:
        print(line)
    if build.returncode:
        raise SystemExit(stderr[-2000:])
    built = json.loads(stdout.strip().splitlines()[-1])
    result = {
        "text_bytes": text_bytes,
        "parquet_bytes": os.path.getsize(corpus),
        "tokens": built["tokens"],
        "build_seconds": built["seconds"],
        "peak_rss_bytes": peak,
        "peak_anonymous_bytes": anon,
        "progress_lines": len([p for p in progress if "tokenizing:" in p]),
    }
    print(f"{'text':<16}{text_bytes / 1e9:8.2f} GB")
    print(f"{'parquet file':<16}{result['parquet_bytes'] / 1e9:8.2f} GB")
    print(f"{'tokens':<16}{built['tokens'] / 1e9:8.2f} G in {built['seconds']:.0f} s")
    print(f"{'peak memory':<16}{anon / 1e9:8.2f} GB (the building process's own, RssAnon)")
    print(f"{'peak resident':<16}{peak / 1e9:8.2f} GB (with the pages of the files it maps)")
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
