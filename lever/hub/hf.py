"""`lever pull REPO/FILE`: a file of a Hugging Face hub repository, through huggingface_hub.

The hub's client says where the file is and what it must be: its URL under $HF_ENDPOINT, the
HEAD answer's ETag (the sha256 of a file kept in LFS, git's blob id of one kept in git), size,
commit and redirect, the caller's token, and its errors (no such repository, file, revision;
a gated one). The bytes then go through lever.hub.download, which resumes a FILE.part across
pulls (hf_hub_download keeps no partial file once it gives up) and checks the digest the hub
gave (hf_hub_download does not). huggingface_hub comes with `tokenizers`; it is imported only
here, and its absence is one line naming the `hub` extra.
"""

from __future__ import annotations

import os
import urllib.parse

import attrs

from lever.errors import LeverError
from lever.hub.download import Digest

DEFAULT_ENDPOINT = "https://huggingface.co"
HEAD_TIMEOUT_S = 20.0
EXAMPLE = "Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf"


def parse_spec(text: str) -> tuple[str, str]:
    """OWNER/REPO/FILE (FILE may hold folders) as (repo id, file), refused in one line otherwise."""
    parts = text.split("/")
    if len(parts) < 3 or any(p in ("", ".", "..") for p in parts) or any(c.isspace() for c in text):
        raise LeverError(f"{text[:120]!r}: not a catalogue name nor OWNER/REPO/FILE (e.g. {EXAMPLE}); "
                         "`lever list` shows the names")
    return "/".join(parts[:2]), "/".join(parts[2:])


def endpoint() -> str:
    """$HF_ENDPOINT (read at each pull, not when huggingface_hub was imported), else the hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub():
    try:
        import huggingface_hub
    except ImportError:
        raise LeverError("pulling REPO/FILE needs huggingface_hub: pip install 'huggingface_hub>=0.26'") from None
    return huggingface_hub


@attrs.frozen
class Remote:
    """What the hub says of one file: where its bytes are, what they must be, the headers to send there."""

    url: str
    location: str
    size: int | None
    digest: Digest | None
    commit: str | None
    headers: dict


def resolve(repo_id: str, filename: str, revision: str = "main") -> Remote:
    """The hub's HEAD for the file, its failures in one line naming the repository and file."""
    hf, ep = hub(), endpoint()
    try:
        url = hf.hf_hub_url(repo_id, filename, revision=revision, endpoint=ep)
        meta = hf.get_hf_file_metadata(url, timeout=HEAD_TIMEOUT_S, endpoint=ep)
    except Exception as e:  # the hub client's errors, its HTTP library's, a refused repo id
        raise LeverError(_why(e, repo_id=repo_id, filename=filename, revision=revision, ep=ep)) from e
    location = urllib.parse.urljoin(url, meta.location or url)
    same_host = urllib.parse.urlsplit(location).netloc == urllib.parse.urlsplit(ep).netloc
    # the token goes to the hub only, never to the storage a redirect points at (its URL is signed)
    headers = dict(hf.utils.build_hf_headers()) if same_host else {}
    return Remote(url=url, location=location, size=meta.size, digest=_digest(meta.etag), commit=meta.commit_hash,
                  headers={k: v for k, v in headers.items() if k.lower() in ("authorization", "user-agent")})


def _digest(etag: str | None) -> Digest | None:
    tag = (etag or "").strip('"').removeprefix("W/").strip('"').lower()
    if len(tag) == 64 and all(c in "0123456789abcdef" for c in tag):
        return Digest("sha256", tag)
    if len(tag) == 40 and all(c in "0123456789abcdef" for c in tag):
        return Digest("git-sha1", tag)
    return None  # an ETag that is no content hash: the size alone is checked


def _why(e: Exception, *, repo_id: str, filename: str, revision: str, ep: str) -> str:
    from huggingface_hub import errors

    status = getattr(getattr(e, "response", None), "status_code", None)
    where = f"on {ep}" + (f" (HTTP {status})" if status else "")
    if isinstance(e, errors.GatedRepoError):
        return f"{repo_id}: a gated repository {where}: accept its terms on its page, then set HF_TOKEN"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"{repo_id}: no such repository {where} (a private one needs HF_TOKEN)"
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{repo_id}: no revision {revision!r} {where}"
    if isinstance(e, errors.EntryNotFoundError):
        return f"{repo_id}: no file {filename} at revision {revision} {where}"
    if isinstance(e, errors.HfHubHTTPError):
        return f"{repo_id}/{filename}: the hub answered HTTP {status} {where}"
    if isinstance(e, ValueError):  # huggingface_hub's check of the repo id
        return f"{repo_id}: not a repository id ({str(e).splitlines()[0][:160]})"
    first = (str(e).splitlines() or [""])[0][:160]
    return f"{ep}: cannot reach the hub for {repo_id}/{filename} ({type(e).__name__}: {first}); check the network " \
           "or HF_ENDPOINT"
