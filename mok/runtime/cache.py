"""JIT on first use, with an in-memory and an on-disk cache of compiled kernels.

A kernel is compiled once per (name, static config, target arch, calling convention, CuTe DSL
version and code-changing settings, fingerprint of MoK's kernel sources). The compiled
host+device code is exported as an object file (CuTe DSL's ``export_to_c``) under
``$MOK_CACHE_DIR`` (default ``~/.cache/mok``) and loaded back with ``cute.runtime.load_module``
by later processes, which then compile nothing. The key holds no install path (a cache built in CI,
in a container build step or in another venv loads in any environment with the same DSL and MoK
sources); the loader links the object against the runtime library of the loading process. Entries
carry a JSON record with the object's SHA-256: a
corrupt, truncated or unreadable entry is rebuilt, never trusted. A file lock per entry
makes concurrent processes compile each kernel once and never read a half-written file. A cache
this process cannot write (a read-only image layer, another user's folder) is read without the
lock, and the kernels it lacks are compiled for this process only (with a warning).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .launch import convention

log = logging.getLogger("mok")

CACHE_DIR_ENV = "MOK_CACHE_DIR"
CACHE_FORMAT = 1  # bump when the layout of entries changes
_KERNEL_SOURCES = Path(__file__).resolve().parent.parent / "kernels"


def default_cache_dir() -> Path:
    """``$MOK_CACHE_DIR`` if set, else ``~/.cache/mok``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "mok"


@functools.lru_cache(maxsize=None)
def dsl_version() -> str:
    """CuTe DSL's version, with those of its compiler package and of TVM-FFI (whose export
    format the tvm_ffi calling convention depends on) where installed."""
    versions = []
    for package in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core", "apache-tvm-ffi"):
        try:
            versions.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return ";".join(versions)


@functools.lru_cache(maxsize=None)
def dsl_settings() -> str:
    """The CuTe DSL settings that change the code it compiles (assertions, debug, line info,
    optimisation level, backend, the runtime library it links: cu12 or cu13), as the DSL's own
    JIT cache keys them, without the target arch (keyed on its own) and without install paths
    (``_path_free``). Read once per process: the DSL reads its environment once too."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    try:
        entries = sorted((e for e in type(envar)._ENV_VAR_SPEC if e.affects_compile and e.key_name != "arch"), key=lambda e: e.key_name)
    except AttributeError:  # a DSL whose settings are laid out otherwise: its own whole key (paths and
        return envar.cache_key_str()  # all: at worst a cache that does not move, never a wrong load)
    rendered = []
    for entry in entries:
        value = getattr(envar, entry.key_name)
        if isinstance(value, (set, frozenset)):
            value = tuple(sorted(value, key=repr))
        if value is not None:
            rendered.append(f"{entry.key_name}={_path_free(value)!r}")
    return ";".join(rendered)


def _path_free(value: Any) -> Any:
    """``value``, with a setting that names files (one absolute path, or several joined by
    ``os.pathsep``) replaced by each file's name and the SHA-256 of its content.

    The DSL's ``shared_libs`` setting (``CUTE_DSL_LIBS``, else found next to the installed DSL) is
    the absolute path of its runtime library, e.g. ``<venv>/.../nvidia_cutlass_dsl/cu13/lib/
    libcute_dsl_runtime.so``. Keyed as such, a byte-identical environment at another path (a
    copied venv, a container, CI) missed every entry. What the setting selects is the library,
    not its location: the content hash tells cu12 from cu13 and a custom build from the wheel's,
    and the path is not in the exported object, which ``cute.runtime.load_module`` links against
    the runtime library the loading process finds (its own ``shared_libs``). A value naming
    anything else (a folder, a path that does not exist) is kept as it is: a cache that does not
    move is safe, a wrong load would not be."""
    if not isinstance(value, str) or not value:
        return value
    parts = value.split(os.pathsep)
    if not all(os.path.isabs(p) and os.path.isfile(p) for p in parts):
        return value
    return os.pathsep.join(f"{os.path.basename(p)}@sha256:{_content_sha256(p)}" for p in parts)


@functools.lru_cache(maxsize=None)
def _content_sha256(path: str) -> str:
    """SHA-256 of a (large) file, read in blocks: ~0.05 s for the 43 MB runtime library, once per process."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def kernel_source_fingerprint() -> str:
    """SHA-256 over every kernel source file: any edit to a kernel invalidates its entries. It hashes
    each file's path relative to ``mok/kernels`` and its content, never where MoK is installed."""
    digest = hashlib.sha256()
    for path in sorted(_KERNEL_SOURCES.rglob("*.py")):
        digest.update(str(path.relative_to(_KERNEL_SOURCES)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class CacheStats:
    """What the cache did in this process: compiled, loaded from disk, or served from memory."""

    compiles: int = 0
    disk_loads: int = 0
    memory_hits: int = 0


class KernelCache:
    """Compiled kernels by key, in memory and on disk (thread- and process-safe)."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.stats = CacheStats()
        self._memory: dict[str, Any] = {}
        self._by_key: dict[tuple, Any] = {}  # (name, config items, arch, convention) -> kernel: the per-call fast path
        self._modules: dict[str, Any] = {}  # keeps loaded object files alive
        self._lock = threading.Lock()
        self._warned_unwritable = False

    # ---- keys and paths -------------------------------------------------------------
    @staticmethod
    def key_record(name: str, config: Mapping[str, Any], arch: str) -> dict:
        """Everything a compiled kernel depends on (the calling convention included: mok/runtime/launch.py)."""
        return {
            "format": CACHE_FORMAT,
            "name": name,
            "config": dict(sorted(config.items())),
            "arch": arch,
            "calling": convention(),
            "dsl_version": dsl_version(),
            "dsl_settings": dsl_settings(),
            "source": kernel_source_fingerprint(),
        }

    @staticmethod
    def digest(record: Mapping[str, Any]) -> str:
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    def _paths(self, name: str, digest: str) -> tuple[Path, Path, Path]:
        folder = self.directory / name
        return folder / f"{digest}.o", folder / f"{digest}.json", folder / f"{digest}.lock"

    # ---- the entry points -------------------------------------------------------------
    def loaded(self, name: str, config: Mapping[str, Any], arch: str) -> Any | None:
        """The kernel if this process already has it, else None: one dict lookup, no hashing of sources."""
        fn = self._by_key.get((name, tuple(sorted(config.items())), arch, convention()))
        if fn is not None:
            self.stats.memory_hits += 1
        return fn

    def get(self, name: str, config: Mapping[str, Any], arch: str, build: Callable[[], Any],
            patch: Callable[[bytearray], int] | None = None) -> Any:
        """The compiled kernel for this key: from memory, else from disk, else ``build()``.

        ``build`` must return a CuTe DSL compiled function (``cute.compile``) for ``arch``. ``patch``
        edits the exported object's bytes before it is stored; the kernel is then loaded from the
        stored object (this process runs the patched code too). A process that cannot write the
        cache runs what it compiles unpatched (patches are scheduling hints, not semantics).
        """
        fn = self.loaded(name, config, arch)
        if fn is not None:
            return fn
        if not name.replace("_", "").isalnum():
            raise ValueError(f"name: expected letters, digits and '_', got {name!r}")
        record = self.key_record(name, config, arch)
        digest = self.digest(record)
        with self._lock:
            fn = self._memory.get(digest)
            if fn is not None:
                self.stats.memory_hits += 1
                return fn
            obj_path, meta_path, lock_path = self._paths(name, digest)
            try:
                obj_path.parent.mkdir(parents=True, exist_ok=True)
                lock_file = open(lock_path, "a")
            except OSError as err:  # a cache this process cannot write (a read-only image layer, another user's):
                fn = self._load(record, digest, obj_path, meta_path)  # read it unlocked (entries are replaced whole)
                if fn is None:
                    self._warn_unwritable(err)
                    fn, _ = self._compile(build)  # and keeps what it lacks in memory only
            else:
                with lock_file:
                    fcntl.flock(lock_file, fcntl.LOCK_EX)
                    try:
                        fn = self._load(record, digest, obj_path, meta_path)
                        if fn is None:
                            fn = self._compile_and_store(record, digest, obj_path, meta_path, build, patch)
                    finally:
                        fcntl.flock(lock_file, fcntl.LOCK_UN)
            self._memory[digest] = fn
            self._by_key[(name, tuple(sorted(config.items())), arch, convention())] = fn
            return fn

    @staticmethod
    def _prefix(name: str, digest: str) -> str:
        return f"mok_{name}_{digest[:16]}"

    def _load(self, record: dict, digest: str, obj_path: Path, meta_path: Path) -> Any | None:
        if not meta_path.exists() and not obj_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("key") != record:
                raise ValueError("its record does not match the requested key")
            if _file_sha256(obj_path) != meta.get("object_sha256"):
                raise ValueError("its object file does not match the recorded checksum")
            fn = self._open(record, digest, obj_path)
        except Exception as err:  # any unreadable entry is rebuilt, never trusted
            log.warning("MoK cache: rebuilding %s (%s): %s", obj_path.name, record["name"], err)
            for path in (obj_path, meta_path):
                with contextlib.suppress(OSError):  # (a read-only cache keeps it; this process compiles its own)
                    path.unlink(missing_ok=True)
            return None
        self.stats.disk_loads += 1
        return fn

    def _open(self, record: dict, digest: str, obj_path: Path) -> Any:
        """The kernel in the object file at ``obj_path`` (its module kept alive with the cache)."""
        from cutlass.cute.runtime import load_module

        module = load_module(str(obj_path), enable_tvm_ffi=record["calling"] == "tvm_ffi")
        fn = module[self._prefix(record["name"], digest)]
        self._modules[digest] = module
        return fn

    def _compile(self, build: Callable[[], Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        fn = build()
        self.stats.compiles += 1
        return fn, time.perf_counter() - start

    def _warn_unwritable(self, err: OSError) -> None:
        if not self._warned_unwritable:
            self._warned_unwritable = True
            log.warning("MoK cache: cannot write to %s (%s): the kernels it lacks are compiled for this process only", self.directory, err)

    def _compile_and_store(self, record: dict, digest: str, obj_path: Path, meta_path: Path, build: Callable[[], Any],
                           patch: Callable[[bytearray], int] | None = None) -> Any:
        fn, seconds = self._compile(build)
        prefix = self._prefix(record["name"], digest)
        with tempfile.TemporaryDirectory(dir=obj_path.parent) as tmp:
            if record["calling"] == "tvm_ffi":  # (its export writes the object file itself)
                fn.export_to_c(str(Path(tmp) / "kernel.o"), function_name=prefix)
            else:
                fn.export_to_c(tmp, "kernel", prefix)
            if patch is not None:
                exported = Path(tmp) / "kernel.o"
                data = bytearray(exported.read_bytes())
                patch(data)
                exported.write_bytes(bytes(data))
            os.replace(Path(tmp) / "kernel.o", obj_path)
        meta = {
            "key": record,
            "object_sha256": _file_sha256(obj_path),
            "compile_seconds": round(seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        tmp_meta = meta_path.with_suffix(".json.tmp")
        tmp_meta.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(tmp_meta, meta_path)
        log.info("MoK cache: compiled %s for %s in %.2fs", record["name"], record["arch"], seconds)
        if patch is not None:  # (the patched object's code, not what was compiled in memory)
            return self._open(record, digest, obj_path)
        return fn

    # ---- inspection -------------------------------------------------------------------
    def entries(self) -> list[dict]:
        """Records of the entries on disk, with their object size in bytes."""
        found = []
        for meta_path in sorted(self.directory.glob("*/*.json")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict) or not isinstance(meta.get("key"), dict):  # damaged, or another format's
                continue
            obj = meta_path.with_suffix(".o")
            meta["bytes"] = obj.stat().st_size if obj.exists() else 0
            meta["path"] = str(obj)
            found.append(meta)
        return found

    def clear(self, name: str | None = None) -> int:
        """Delete entries on disk (all, or those of one kernel); returns how many."""
        if name is not None and not name.replace("_", "").isalnum():
            raise ValueError(f"name: expected a kernel name (letters, digits and '_'), got {name!r}")
        folders = [self.directory / name] if name else [p for p in self.directory.glob("*") if p.is_dir()]
        removed = 0
        for folder in folders:
            if folder.is_dir():
                removed += len(list(folder.glob("*.json")))
                shutil.rmtree(folder)
        with self._lock:
            self._memory.clear()
            self._by_key.clear()
        return removed


_default: KernelCache | None = None
_default_env: str | None = None
_default_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache in ``default_cache_dir()`` (re-created if MOK_CACHE_DIR changes)."""
    global _default, _default_env
    env = os.environ.get(CACHE_DIR_ENV)
    if _default is not None and env == _default_env:
        return _default
    with _default_lock:
        if _default is None or env != _default_env:
            _default, _default_env = KernelCache(), env
        return _default
