"""The demo's pipeline leg: `classify` (JPEG bytes -> labels, scores) and `embed-text` (UTF-8 text ->
embedding) driven over the native socket and the KServe v2 HTTP face (classify as the binary
extension's BYTES, embed-text as JSON strings), every answer checked against the same steps run
in-process (tgw.workers.demo_reference: labels equal, scores and embeddings within 1e-5); then a
corrupt JPEG sent among good ones at the same moment, answered INVALID_ARGUMENT while the others
in its decode batch are served. Used by scripts/demo_traffic.py.
"""
from __future__ import annotations

import glob
import os

import numpy as np

import demo_http
from demo_load import closed_loop
from tgw.client import AsyncClient, Client

PIPELINES = ("classify", "embed-text")
STAGES = ("decode-image", "top5", "tokenize", "l2-normalize")   # served for the pipelines: driven through them
TOLERANCE = 1e-5
CORRUPT = b"\xff\xd8\xff\xe0 this is not a JPEG: the demo's corrupt image"
SENTENCES = [
    "A model server answers each caller with the output of a model.",
    "The broker forms a batch and copies it into shared memory.",
    "Only the broken picture's own request fails.",
    "The owl called from the forest.",
    "Sentences of different lengths are padded or cut to one length so that many of them fit in one "
    "rectangular batch, which the embedding model computes at once.",
    "Measuring comes before choosing.",
    "Zebras and pelicans are not in every vocabulary",
    "tgw",
]


def demo_items(models_dir: str) -> dict[str, list[bytes]]:
    """What each pipeline is sent: the demo's JPEGs; short and long sentences (UTF-8)."""
    images = [open(p, "rb").read() for p in sorted(glob.glob(os.path.join(models_dir, "images", "*.jpg")))]
    if not images:
        raise SystemExit(f"no demo images in {models_dir}/images: the broker builds them when it starts the demo")
    return {"classify": images, "embed-text": [s.encode() for s in SENTENCES]}


def drive(address: str, pipeline: str, items: list[bytes], n: int, http: str | None = None) -> tuple:
    """n requests of 1-4 items each from CONCURRENCY threads (native, or HTTP at `http`);
    returns (records [(sent items, answer)], latencies, errors, seconds)."""
    name = "image" if pipeline == "classify" else "text"
    meta = {"name": pipeline}

    def call(c: Client, rng: np.random.Generator) -> tuple:
        sent = [items[i] for i in rng.integers(0, len(items), int(rng.integers(1, 5)))]
        return sent, demo_http.infer(http, meta, {name: sent}, binary=pipeline == "classify") if http \
            else c.infer(pipeline, {name: sent}, timeout=30)

    return closed_loop(address, n, call)


def agrees(pipeline: str, answer: dict, row: int, ref: dict) -> bool:
    """One row of a served answer against the in-process reference's."""
    if "error" in ref:
        return False
    if pipeline == "classify":
        labels = [bytes(x) for x in np.asarray(answer["labels"])[row]]
        return labels == list(ref["labels"]) and \
            np.allclose(np.asarray(answer["scores"])[row], ref["scores"], rtol=0, atol=TOLERANCE)
    return np.allclose(np.asarray(answer["embedding"])[row], ref["embedding"], rtol=0, atol=TOLERANCE)


def mismatches(records: list, reference, pipeline: str) -> int:
    """Answers whose rows differ from `reference.run(pipeline, ...)` (tgw.workers.demo_reference)."""
    bad = 0
    for sent, answer in records:
        refs = reference.run(pipeline, sent)
        bad += not all(agrees(pipeline, answer, row, ref) for row, ref in enumerate(refs))
    return bad


def corrupt_burst(address: str, images: list[bytes], burst: int = 16) -> dict:
    """`burst` one-image requests sent at once from one AsyncClient, one of them (the middle one)
    a corrupt JPEG, queued behind a 32-image request that keeps the decode stage busy meanwhile,
    so the burst's requests meet in decode batches. Returns what each got and the decode batches
    the burst formed (the stage's stats before and after)."""
    import asyncio
    bad_at = burst // 2

    async def main() -> list:
        async with AsyncClient(address) as c:
            filler = asyncio.ensure_future(c.infer("classify", {"image": [images[-1]] * 32}, timeout=30))
            await asyncio.sleep(0)
            sends = [c.infer("classify", {"image": [CORRUPT if i == bad_at else images[i % len(images)]]}, timeout=30)
                     for i in range(burst)]
            out = await asyncio.gather(*sends, return_exceptions=True)
            await filler
            return out

    with Client(address) as c:
        before = c.stats()["models"]["decode-image"]
        answers = asyncio.run(main())
        after = c.stats()["models"]["decode-image"]
    sizes = {k: v - before["batch_sizes"].get(k, 0) for k, v in after["batch_sizes"].items()}
    sizes = {int(k): v for k, v in sizes.items() if v}
    sizes.pop(32, None) if sizes.get(32) == 1 else None   # the filler's own batch
    bad = answers[bad_at]
    return {"burst": burst, "served": sum(not isinstance(a, Exception) for a in answers),
            "failed_code": getattr(getattr(bad, "code", None), "value", None), "failed_message": str(bad),
            "others_failed": sum(isinstance(a, Exception) for i, a in enumerate(answers) if i != bad_at),
            "batch_sizes": dict(sorted(sizes.items()))}


def run(address: str, http: str, models_dir: str, requests: int) -> tuple[list, bool]:
    """Both pipelines on both faces, checked; then the corrupt burst. Returns (table rows as
    demo_traffic prints them, failed)."""
    items, rows, failed, done = demo_items(models_dir), [], False, []
    for face, url in (("native", None), ("HTTP", http)):
        for pipeline in PIPELINES:
            done.append((pipeline, face, drive(address, pipeline, items[pipeline], requests, url)))
    from tgw.workers.demo_reference import DemoPipelines   # imports torch: after the timed traffic
    reference = DemoPipelines(models_dir)
    for pipeline, face, (records, lat, errors, elapsed) in done:
        bad = mismatches(records, reference, pipeline)
        ms = np.array(lat) * 1e3 if lat else np.array([np.nan])
        rows.append((pipeline, face, len(lat) + len(errors), len(errors), bad, np.percentile(ms, 50),
                     np.percentile(ms, 99), len(lat) / elapsed))
        failed |= bool(errors) or bad > 0 or len(lat) != requests
    return rows, failed


def show_burst(address: str, models_dir: str) -> bool:
    """Print the corrupt-image burst; True when it went as it should."""
    r = corrupt_burst(address, demo_items(models_dir)["classify"])
    ok = r["failed_code"] == "INVALID_ARGUMENT" and "not a decodable JPEG" in r["failed_message"] and \
        r["others_failed"] == 0 and r["served"] == r["burst"] - 1
    shared = max(r["batch_sizes"], default=0)
    print(f"\ncorrupt image among {r['burst']} concurrent classify requests: {r['served']} served, the corrupt one "
          f"answered {r['failed_code']}:\n  {r['failed_message']}\n  decode batches of the burst (size: count) "
          f"{r['batch_sizes']}: up to {shared} requests shared one decode batch")
    return ok
