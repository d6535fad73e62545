"""Reads a TensorBoard log folder with TensorBoard's own EventAccumulator and prints, as JSON,
every scalar as [step, value] pairs, every text summary (the last of each tag, and all of
them with their steps) and every image as [step, width, height, sha256 of the PNG]. Exits with 3 when the
`tensorboard` package is not installed (`pip install tensorboard`)."""
import hashlib
import json
import sys

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:
    print(f"tensorboard is not installed: {e}", file=sys.stderr)
    sys.exit(3)

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0, "images": 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {}, "text": {}, "texts": {}, "images": {}}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, e.value] for e in acc.Scalars(tag)]
for tag in tags["tensors"]:
    # Text summaries arrive as string tensors (the text plugin's format).
    # "text": the last text of each tag; "texts": every one, as [step, text] pairs.
    for e in acc.Tensors(tag):
        text = b"".join(e.tensor_proto.string_val).decode()
        out["text"][tag] = text
        out["texts"].setdefault(tag, []).append([e.step, text])
for tag in tags["images"]:
    out["images"][tag] = [
        [e.step, e.width, e.height, hashlib.sha256(e.encoded_image_string).hexdigest()]
        for e in acc.Images(tag)
    ]
json.dump(out, sys.stdout)
