"""Constants kept outside the AOTInductor package: where their values come from, and which the code never reads.

``precast.compile`` builds packages without their weights (``aot_inductor.package_constants_in_so=False``) and
hands the loader tensors precast owns with ``user_managed=True``: the loader keeps their pointers, so a process
holds each weight once (with the weights inside the .so, the loader copied them out and the .so pages stayed
resident: about twice). Their values come from the program itself, or for a program whose constants are fake or
meta (converted with streamed weights) from safetensors files: one file, or a directory of shards with a
transformers-style ``model.safetensors.index.json``. safetensors never runs code; each file's header is checked
against its size by the safetensors reader, and names, shapes and dtypes against the program before native code
sees a tensor.

Input: a program, a path, a package. Output: ``SafetensorsSource`` (tensors read one at a time), the program's
constants by stored name, placeholders to compile a fake-weight program, and the constants its code never reads.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch.export import ExportedProgram

from precast.errors import PrecastError, first_line

INDEX = "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def is_fake(value: object) -> bool:
    """A tensor without data: on the meta device or a FakeTensor (a program converted with streamed weights)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, torch.Tensor) and (value.device.type == "meta" or isinstance(value, FakeTensor))


def tensor_constants(ep: ExportedProgram) -> dict[str, torch.Tensor]:
    """The program's tensor constants (parameters, buffers, lifted constants) by stored name."""
    return {k: v for k, v in {**ep.state_dict, **ep.constants}.items() if isinstance(v, torch.Tensor)}


class SafetensorsSource(Mapping[str, torch.Tensor]):
    """The tensors of one ``.safetensors`` file or of a directory of shards, read one at a time (``items()``
    goes file by file, so a caller that keeps only what it derives holds about one tensor of the files)."""

    def __init__(self, path: str | os.PathLike, what: str):
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise PrecastError(f"{what}: reading {path} needs safetensors; pip install safetensors") from exc
        self._open = safe_open
        self.path = Path(path)
        self._what = what
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {}
        files, index = self._files()
        for file in files:
            with self._opened(file) as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                    if name in self._where:
                        raise PrecastError(
                            f"{what}: tensor {name!r} is in both {self._where[name].name} and {file.name}; "
                            "each name must be in one shard"
                        )
                    sl = f.get_slice(name)
                    dtype = sl.get_dtype()
                    self._where[name] = file
                    self._meta[name] = (tuple(sl.get_shape()), _DTYPES.get(dtype, dtype))
        if index is not None:
            wrong = sorted(n for n, file in index.items() if self._where.get(n, Path()).name != file)
            if wrong:
                raise PrecastError(
                    f"{what}: {INDEX} in {self.path} maps {wrong[:8]} to shards that do not hold them; "
                    "rewrite the index from the shards"
                )

    def _files(self) -> tuple[list[Path], dict[str, str] | None]:
        if self.path.is_file():
            return [self.path], None
        if not self.path.is_dir():
            raise PrecastError(
                f"{self._what}: {self.path} is neither a .safetensors file nor a directory; pass one"
            )
        index_path = self.path / INDEX
        if not index_path.exists():
            files = sorted(self.path.glob("*.safetensors"))
            if len(files) != 1:
                raise PrecastError(
                    f"{self._what}: {self.path} has no {INDEX} and {len(files)} .safetensors files; "
                    f"write the index (transformers' format) or pass one file"
                )
            return files, None
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PrecastError(
                f"{self._what}: {index_path} is not a transformers index (a JSON object with a weight_map of "
                f"name -> shard file) ({type(exc).__name__}); rewrite it"
            ) from exc
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if "/" in n or "\\" in n or n.startswith(".")]
        if outside:
            raise PrecastError(f"{self._what}: {index_path} names files outside {self.path}: {outside[:4]}")
        absent = [n for n in names if not (self.path / n).is_file()]
        if absent:
            raise PrecastError(f"{self._what}: {index_path} names shards that are not there: {absent[:8]}")
        return [self.path / n for n in names], dict(weight_map)

    def _opened(self, file: Path):  # noqa: ANN202 - safetensors' handle
        try:
            return self._open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for a bad header or a short file
            raise PrecastError(
                f"{self._what}: {file} is not a valid safetensors file ({first_line(exc)[:160]}); "
                "re-write it (a truncated or damaged file is refused before any tensor is read)"
            ) from exc

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        """Shape and dtype from the header (no data read); an unknown dtype stays its safetensors name."""
        return self._meta[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._opened(self._where[name]) as f:
            return f.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def read(self, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for ``names``, one file open at a time."""
        for file in sorted(set(self._where.values())):
            wanted = [n for n, f in self._where.items() if f == file and n in names]
            if wanted:
                with self._opened(file) as f:
                    for name in wanted:
                        yield name, f.get_tensor(name)


def check_stored(source: SafetensorsSource, program: Mapping[str, torch.Tensor], needed: set[str], what: str):
    """One line listing every missing, unexpected and mismatched name of ``source`` against the program's
    constants (stored names, stored dtypes); ``needed``: the names the compiled code reads."""
    missing = sorted(needed - set(source))
    unexpected = sorted(set(source) - set(program))
    mismatched = []
    for name in sorted(set(source) & set(program)):
        shape, dtype = source.meta(name)
        want = program[name]
        if shape != tuple(want.shape) or dtype != want.dtype:
            mismatched.append(
                f"{name} is {dtype} {list(shape)}, the program stores {want.dtype} {list(want.shape)}"
            )
    problems = (
        ([f"missing {missing}"] if missing else [])
        + ([f"unexpected {unexpected}"] if unexpected else [])
        + mismatched
    )
    if problems:
        raise PrecastError(
            f"{what}: {source.path} does not match the program's constants: {'; '.join(problems)}; "
            "pass the weights written by the conversion of this program (stored names and dtypes)"
        )


def with_placeholders(ep: ExportedProgram, device: str) -> ExportedProgram:
    """A copy of ``ep`` whose fake/meta constants are uninitialized tensors on ``device`` (same shape, stride and
    dtype). A compile whose constants stay outside the package reads their metadata, not their values; the pages
    of an untouched ``torch.empty`` are never made resident."""

    def real(v: object) -> object:
        if not is_fake(v):
            return v
        t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return torch.nn.Parameter(t, requires_grad=False) if isinstance(v, torch.nn.Parameter) else t

    state = {k: real(v) for k, v in ep.state_dict.items()}
    constants = {k: real(v) for k, v in ep.constants.items()}
    out = ep._update(ep.graph_module, ep.graph_signature, state_dict=state, constants=constants)
    out.example_inputs = ep.example_inputs
    return out


_INFO = re.compile(r'constants_info_\[(\d+)\]\.(name|original_fqn) = "([^"]*)";')


def package_constants(package: Path) -> tuple[list[str], list[str]] | None:
    """``(every constant the package's code declares, those it never reads)``, by original FQN, from the
    generated wrapper source in the package; None when the package has no single wrapper source to read.

    A constant is unread when its C name occurs only in its ``constants_info_`` entry and its
    ``auto& NAME = constants_->at(i);`` binding (max-autotune's GEMM template reads a packed copy instead)."""
    with zipfile.ZipFile(package) as z:
        wrappers = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        if len(wrappers) != 1:
            return None
        text = z.read(wrappers[0]).decode("utf-8", "replace")
    info: dict[str, dict[str, str]] = {}
    for idx, field, value in _INFO.findall(text):
        info.setdefault(idx, {})[field] = value
    if not info or any(set(d) != {"name", "original_fqn"} for d in info.values()):
        return None
    every, unread = [], []
    for idx, d in sorted(info.items(), key=lambda kv: int(kv[0])):
        every.append(d["original_fqn"])
        cname = re.escape(d["name"])
        binding = re.compile(rf"auto& {cname} = constants_->at\({idx}\);")
        uses = [
            line
            for line in re.findall(rf"^.*\b{cname}\b.*$", text, flags=re.M)
            if not _INFO.search(line) and not binding.search(line)
        ]
        if not uses:
            unread.append(d["original_fqn"])
    return every, unread
