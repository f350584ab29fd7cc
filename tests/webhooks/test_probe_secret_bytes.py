"""A secret given as bytes (as ``os.environb`` or a file read in binary hands it over) is refused
at set-up saying so, for every scheme; it was taken for a list of numbers and refused as
"secret #1 must be a non-empty string", which names neither bytes nor the fix. A rotated list
with an empty entry is refused naming the entry, and the message never carries a secret."""

from __future__ import annotations

import pytest

from pgonce.errors import ConfigError
from pgonce.webhooks.schemes import SCHEMES, build_scheme

OPTIONS: dict[str, dict[str, object]] = {"generic-hmac": {"header": "x-signature"}}
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize(
    "secrets",
    [SECRET.encode(), bytearray(SECRET.encode()), [SECRET.encode()], [SECRET, SECRET.encode()]],
    ids=["bytes", "bytearray", "list-of-bytes", "rotated-with-bytes"],
)
def test_a_secret_given_as_bytes_is_refused_naming_bytes(scheme: str, secrets: object) -> None:
    with pytest.raises(ConfigError, match="not bytes") as refused:
        build_scheme(scheme, secrets, options=OPTIONS.get(scheme))  # type: ignore[arg-type]
    assert "MfKQ9r8G" not in str(refused.value)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_rotated_list_with_an_empty_entry_is_refused_naming_it(scheme: str) -> None:
    with pytest.raises(ConfigError, match=r"secret #2 .* non-empty string") as refused:
        build_scheme(scheme, [SECRET, ""], options=OPTIONS.get(scheme))
    assert "MfKQ9r8G" not in str(refused.value)
