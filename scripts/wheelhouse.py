"""The wheelhouse a GPU host without network installs from (scripts/wheelhouse.sh builds it, scripts/gpu.sh reads it).

A GPU host has its own Python and CUDA torch but no registry, and takes files in loads of at most 64 MiB. So the wheels
travel as one uncompressed tar cut into pieces of at most `--piece-mib` MiB, beside a manifest of each piece's and
each wheel's size and sha256: a piece lost, cut short or altered in transit is refused in one line before anything is
installed, never found later as a broken import. `join` needs only the standard library (it runs before anything is
installed); `collect`, run where the registries are, reads the installed distributions' metadata.

    python scripts/wheelhouse.py collect --python 3.12 > requirements.txt   # the pins to download (not torch's)
    python scripts/wheelhouse.py split WHEELS_DIR PIECES_DIR [--piece-mib 60] [--python 3.12]
    python scripts/wheelhouse.py join PIECES_DIR WHEELS_DIR
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
TAR = "wheelhouse.tar"
CHUNK = 1 << 20
# What a CUDA torch host already has and no wheelhouse may replace: torch and its CUDA builds' own binaries. torch's
# pure-Python requirements (filelock, fsspec, jinja2, sympy, ...) travel: a host's copy may miss another pin's range
# (datasets caps fsspec), and pip keeps the host's where it fits.
HOST_PROVIDED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")


class WheelhouseError(Exception):
    """A wheelhouse that cannot be used as it is; one-line message."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _tar_of(wheels: list[Path], tar_path: Path) -> None:
    """The wheels in one uncompressed tar (they are zip files already), flat, in name order, with fixed metadata so
    that the same wheels give the same bytes."""
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for wheel in wheels:
            info = tarfile.TarInfo(wheel.name)
            info.size, info.mode, info.mtime = wheel.stat().st_size, 0o644, 0
            with wheel.open("rb") as f:
                tar.addfile(info, f)


def split(wheels_dir: Path, out: Path, piece_mib: int, python: str) -> dict:
    """The wheels under `wheels_dir` as `out`/wheelhouse.tar.partNNN pieces of <= piece_mib MiB plus manifest.json,
    written beside `out` and renamed into place; the manifest."""
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise WheelhouseError(f"{wheels_dir}: no .whl files to pack")
    if piece_mib < 1:
        raise WheelhouseError(f"--piece-mib {piece_mib}: a piece holds at least 1 MiB")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _tar_of(wheels, tmp / TAR)
    pieces, limit = [], piece_mib << 20
    with (tmp / TAR).open("rb") as whole:
        while block := whole.read(limit):
            piece = tmp / f"{TAR}.part{len(pieces):03d}"
            piece.write_bytes(block)
            pieces.append({"name": piece.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"python": python, "piece_mib": piece_mib, "tar_bytes": (tmp / TAR).stat().st_size,
                "tar_sha256": sha256_of(tmp / TAR), "pieces": pieces,
                "wheels": [{"name": w.name, "bytes": w.stat().st_size, "sha256": sha256_of(w)} for w in wheels]}
    (tmp / TAR).unlink()
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return manifest


def _read_manifest(pieces_dir: Path) -> dict:
    try:
        return json.loads((pieces_dir / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise WheelhouseError(f"{pieces_dir / MANIFEST}: unreadable ({type(err).__name__}); "
                              "copy the whole wheelhouse folder again") from None


def _joined(pieces_dir: Path, manifest: dict, work: Path) -> io.BufferedRandom:
    """The pieces, each checked against the manifest, concatenated into an anonymous file under `work` (the pieces'
    folder may be read-only) and checked as a whole."""
    whole, digest = tempfile.TemporaryFile(dir=work), hashlib.sha256()
    for piece in manifest["pieces"]:
        path = pieces_dir / piece["name"]
        if not path.is_file():
            raise WheelhouseError(f"{path}: missing piece ({len(manifest['pieces'])} expected); copy it again")
        data = path.read_bytes()
        if len(data) != piece["bytes"] or hashlib.sha256(data).hexdigest() != piece["sha256"]:
            raise WheelhouseError(f"{path}: corrupt piece ({len(data)} bytes, sha256 differs from the manifest's); "
                                  "copy it again")
        whole.write(data)
        digest.update(data)
    if digest.hexdigest() != manifest["tar_sha256"]:
        raise WheelhouseError(f"{pieces_dir}: the joined pieces differ from the wheelhouse the manifest describes")
    whole.seek(0)
    return whole


def join(pieces_dir: Path, out: Path) -> list[Path]:
    """The wheels of the pieces under `pieces_dir`, verified piece by piece, as a whole and wheel by wheel, extracted
    beside `out` and renamed into place; their paths."""
    manifest = _read_manifest(pieces_dir)
    expected = {w["name"]: w for w in manifest["wheels"]}
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _joined(pieces_dir, manifest, tmp) as whole, tarfile.open(fileobj=whole, mode="r:") as tar:
        for member in tar:
            wheel = expected.get(member.name)
            if wheel is None or not member.isfile() or "/" in member.name:
                raise WheelhouseError(f"{pieces_dir}: unexpected entry {member.name!r} in the wheelhouse")
            source = tar.extractfile(member)
            with (tmp / member.name).open("wb") as f:
                shutil.copyfileobj(source, f, CHUNK)
            if sha256_of(tmp / member.name) != wheel["sha256"]:
                raise WheelhouseError(f"{member.name}: sha256 differs from the manifest's")
    missing = sorted(set(expected) - {p.name for p in tmp.iterdir()})
    if missing:
        raise WheelhouseError(f"{pieces_dir}: {len(missing)} wheels of the manifest missing, first {missing[0]}")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return sorted(out.glob("*.whl"))


def _marker_env(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def closure(roots: list[str], python: str) -> tuple[dict[str, str], list[str]]:
    """The installed distributions `roots` (requirement strings) need on Python `python` (Linux x86_64), as
    {name: version}, and the requirements no installed distribution satisfies (downloaded by their specifier)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, unresolved, seen, todo = {}, [], set(), [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if ((req.marker is not None and not req.marker.evaluate({**_marker_env(python), "extra": extra}))
                or (name, extras) in seen):
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            unresolved.append(str(req).split(";")[0])
            continue
        found[name] = dist.version
        todo += [(Requirement(r), e) for r in dist.requires or [] for e in ("", *extras)]
    return found, sorted(set(unresolved))


def collect(python: str, extra: str) -> list[str]:
    """Pins of everything the project (with its `extra`) needs on Python `python`, from the distributions installed
    here (scripts/setup.sh's pins), less the project itself and what a CUDA torch host already has (HOST_PROVIDED)."""
    from packaging.utils import canonicalize_name

    needed, unresolved = closure([f"polyspec[{extra}]" if extra else "polyspec"], python)
    pins = [f"{name}=={version}" for name, version in sorted(needed.items())
            if name != "polyspec" and not HOST_PROVIDED.match(name)]
    return pins + [r for r in unresolved if not HOST_PROVIDED.match(canonicalize_name(re.split(r"[<>=!~ \[]", r)[0]))]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="print the pins to download, one a line")
    c.add_argument("--python", default="3.12")
    c.add_argument("--extra", default="test")
    s = sub.add_parser("split", help="pack WHEELS into pieces under OUT")
    s.add_argument("wheels", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--piece-mib", type=int, default=60)
    s.add_argument("--python", default="3.12")
    j = sub.add_parser("join", help="verify the pieces under PIECES and extract their wheels into OUT")
    j.add_argument("pieces", type=Path)
    j.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "collect":
            print("\n".join(collect(args.python, args.extra)))
        elif args.command == "split":
            m = split(args.wheels, args.out, args.piece_mib, args.python)
            print(f"wheelhouse: {len(m['wheels'])} wheels, {m['tar_bytes'] / 2**20:.1f} MiB in {len(m['pieces'])} "
                  f"pieces of <= {args.piece_mib} MiB under {args.out}")
        else:
            wheels = join(args.pieces, args.out)
            print(f"wheelhouse: {len(wheels)} wheels verified and extracted into {args.out}")
    except WheelhouseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
