"""URLs as pgonce shows them: never with a password, a token or any other query value."""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

#: What stands in for a hidden part.
HIDDEN = "***"


def public(url: str) -> str:
    """``url`` as a report or an error may show it, its scheme, host, port and path kept.

    A password in its user part is replaced by ``***`` (httpx sends it as Basic credentials; a
    report is pasted into CI logs and tickets), and so is every value of its query string
    (``?token=``, ``?api_key=``, ``?sig=`` carry credentials as often as a user part does) and
    its fragment; the query's names stay, so that the URL can still be recognised. A URL that
    does not even split is hidden the same way, by hand: this never raises. A control character
    (which no URL holds unencoded; a server's Location may) is shown percent-encoded, so that
    the URL cannot drive the terminal it is printed on.
    """
    url = _encoded_controls(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return public_unparsed(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:{HIDDEN}@{netloc.rpartition('@')[2]}"
    if netloc == parts.netloc and not parts.query and not parts.fragment:
        return url
    return urlunsplit(
        parts._replace(
            netloc=netloc,
            query=_query(parts.query),
            fragment=HIDDEN if parts.fragment else "",
        )
    )


def _encoded_controls(url: str) -> str:
    """``url`` with C0, DEL and C1 characters percent-encoded (their UTF-8 bytes)."""
    return "".join(quote(c, safe="") if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 else c for c in url)


def _query(query: str) -> str:
    """``a=1&token=s`` as ``a=***&token=***``; a piece without a name (``?s3cr3t``) is hidden."""
    shown = []
    for piece in query.split("&") if query else []:
        name, sep, value = piece.partition("=")
        shown.append(f"{name}{sep}{HIDDEN if value else ''}" if sep else HIDDEN if piece else "")
    return "&".join(shown)


def public_unparsed(url: str) -> str:
    """``public`` for a URL that does not split (a bad IPv6 bracket): the whole user part, the
    query's values and the fragment hidden as text."""
    url = _encoded_controls(url)
    head, hash_, fragment = url.partition("#")
    head, mark, query = head.partition("?")
    scheme, slashes, rest = head.partition("//")
    if slashes:
        authority, slash, path = rest.partition("/")
        _, at, host = authority.rpartition("@")
        head = f"{scheme}//{HIDDEN}@{host}{slash}{path}" if at else head
    return f"{head}{mark}{_query(query)}{hash_}{HIDDEN if fragment else ''}"
