"""Writes test datasets with the real Python writers: mosaicml-streaming's MDSWriter and
pyarrow's Parquet writer (PyPI packages; `.ci/run` installs them). Prints one JSON line
describing what it wrote, which the Rust tests compare against what they read.

Usage: write_shards.py mds <out> <compression or "none"> <hashes, comma-separated>
       write_shards.py parquet <out> <compression>
       write_shards.py mnist-mds <idx folder> <out> <size limit> <compression or "none">

mosaicml-streaming's package imports its dataset classes (torch, torchvision, transformers:
gigabytes) from its `__init__`; the writer itself uses none of them. Where torch is missing,
the writer's modules are loaded from the installed package's files without running those two
`__init__` files, and `torch` and its submodules are empty shells (imported at module level
by `streaming.base.util`, `.distributed` and `.world` for helpers and annotations the writer
never calls). Where torch is installed, the package is
imported as usual.
"""

import importlib.util
import json
import pathlib
import sys
import types


class _TorchShells:
    """Imports of `torch` and its submodules give empty package shells whose every attribute
    is an empty class: enough for module-level imports and annotations."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


def mds_writer():
    if importlib.util.find_spec("torch") is not None:
        from streaming import MDSWriter
        return MDSWriter
    spec = importlib.util.find_spec("streaming")
    if spec is None:
        sys.exit(3)  # mosaicml-streaming is missing: the test skips
    root = pathlib.Path(spec.origin).parent
    for name, path in (("streaming", root), ("streaming.base", root / "base")):
        shell = types.ModuleType(name)
        shell.__path__ = [str(path)]
        sys.modules[name] = shell
    sys.meta_path.insert(0, _TorchShells())
    from streaming.base.format.mds.writer import MDSWriter
    return MDSWriter


def every_encoding(out, compression, hashes):
    import numpy as np
    from decimal import Decimal
    from PIL import Image

    MDSWriter = mds_writer()
    columns = {
        "b": "bytes", "s": "str", "i": "int", "u8": "uint8", "u16": "uint16", "u32": "uint32",
        "u64": "uint64", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
        "f16": "float16", "f32": "float32", "f64": "float64", "si": "str_int",
        "sf": "str_float", "sd": "str_decimal", "nd": "ndarray", "ndt": "ndarray:int16",
        "nds": "ndarray:float32:2,3", "pil": "pil", "png": "png", "js": "json",
        "lpng": "list[png]",
    }
    expected = []
    with MDSWriter(out=out, columns=columns, compression=compression, hashes=hashes,
                   size_limit=1 << 12) as w:
        for k in range(40):
            rng = np.random.default_rng(k)
            nd = rng.integers(0, 255, size=(1 + k % 3, 2 + k % 4), dtype=np.uint8)
            ndt = (np.arange(3 + k % 5, dtype=np.int16) - 7 * k).astype(np.int16)
            nds = (np.arange(6, dtype=np.float32) * 0.25 - k).reshape(2, 3)
            img = Image.fromarray(np.full((2 + k % 3, 3), k, dtype=np.uint8), mode="L")
            sample = {
                "b": bytes([k, 255 - k]) * (k % 5), "s": f"sample {k} é", "i": -(k ** 5),
                "u8": k, "u16": 1000 + k, "u32": 70000 + k, "u64": 2 ** 40 + k,
                "i8": -k, "i16": -300 - k, "i32": -70000 - k, "i64": -(2 ** 40) - k,
                "f16": np.float16(k / 4), "f32": np.float32(k / 3), "f64": k / 7.0,
                "si": k * 11, "sf": k + 0.5, "sd": Decimal(f"{k}.25"), "nd": nd,
                "ndt": ndt, "nds": nds, "pil": img, "png": img, "js": {"k": k, "l": [1, 2]},
                "lpng": [img, img],
            }
            w.write(sample)
            expected.append({
                "b": list(sample["b"]), "s": sample["s"], "i": sample["i"], "u8": k,
                "u16": 1000 + k, "u32": 70000 + k, "u64": 2 ** 40 + k, "i8": -k,
                "i16": -300 - k, "i32": -70000 - k, "i64": -(2 ** 40) - k,
                "f16": float(np.float16(k / 4)), "f32": float(np.float32(k / 3)),
                "f64": k / 7.0, "si": k * 11, "sf": k + 0.5, "sd": f"{k}.25",
                "nd": {"shape": list(nd.shape), "data": nd.flatten().tolist()},
                "ndt": ndt.tolist(), "nds": nds.flatten().tolist(),
                "pil": {"mode": "L", "width": 3, "height": 2 + k % 3},
                "js": {"k": k, "l": [1, 2]},
            })
    return {"samples": expected}


def parquet(out, compression):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    rows = []
    for f in range(3):
        n = 5 + 3 * f
        ks = list(range(sum(5 + 3 * g for g in range(f)), sum(5 + 3 * g for g in range(f)) + n))
        table = pa.table({
            "label": pa.array([k % 10 for k in ks], pa.int64()),
            "text": pa.array([f"row {k}" for k in ks], pa.string()),
            "pixels": pa.array([bytes([k % 256] * 4) for k in ks], pa.binary()),
            "score": pa.array([k / 8 for k in ks], pa.float32()),
            "tokens": pa.array([[k, k + 1, k + 2][: 1 + k % 3] for k in ks],
                               pa.list_(pa.int32())),
            "maybe": pa.array([None if k % 4 == 0 else k for k in ks], pa.int32()),
        })
        pq.write_table(table, f"{out}/part-{f:03d}.parquet", compression=compression,
                       row_group_size=4)
        rows += [{"label": k % 10, "text": f"row {k}", "pixels": [k % 256] * 4,
                  "score": k / 8, "tokens": [k, k + 1, k + 2][: 1 + k % 3],
                  "maybe": None if k % 4 == 0 else k} for k in ks]
    return {"rows": rows}


def mnist_mds(idx, out, size_limit, compression):
    import gzip
    import numpy as np

    MDSWriter = mds_writer()
    def read(name):
        data = gzip.open(f"{idx}/{name}", "rb").read()
        return data
    images = read("train-images-idx3-ubyte.gz")
    labels = read("train-labels-idx1-ubyte.gz")
    n = int.from_bytes(labels[4:8], "big")
    with MDSWriter(out=out, columns={"x": "ndarray:uint8:28,28", "y": "int"},
                   compression=compression, size_limit=int(size_limit)) as w:
        for i in range(n):
            x = np.frombuffer(images[16 + 784 * i: 16 + 784 * (i + 1)], np.uint8).reshape(28, 28)
            w.write({"x": x, "y": int(labels[8 + i])})
    return {"samples": n}


def main():
    try:
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError:
        sys.exit(3)  # a writer's package is missing: the test skips
    kind = sys.argv[1]
    if kind == "mds":
        comp = None if sys.argv[3] == "none" else sys.argv[3]
        hashes = [h for h in sys.argv[4].split(",") if h]
        result = every_encoding(sys.argv[2], comp, hashes)
    elif kind == "parquet":
        result = parquet(sys.argv[2], sys.argv[3])
    elif kind == "mnist-mds":
        comp = None if sys.argv[5] == "none" else sys.argv[5]
        result = mnist_mds(sys.argv[2], sys.argv[3], sys.argv[4], comp)
    else:
        raise SystemExit(f"unknown kind {kind}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
