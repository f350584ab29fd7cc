"""Deliveries signed by the providers' own published libraries, where a provider publishes one.

A receiver that accepts pgonce's signatures but not the provider's has misread the provider's
rules together with pgonce; signing with the provider's own code settles it. The libraries are
optional: when one is not installed, the check says which package to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

#: Signs (body, event id, timestamp) into the delivery's headers.
Sign = Callable[[bytes, str, datetime], dict[str, str]]


@dataclass(frozen=True)
class ProviderSigner:
    library: str
    sign: Sign


#: Scheme -> (the module, the PyPI package that provides it).
LIBRARIES = {
    "standard-webhooks": ("standardwebhooks", "standardwebhooks"),
    "stripe": ("stripe", "stripe"),
    "slack": ("slack_sdk", "slack-sdk"),
}

#: Why a scheme has no provider library to sign with.
NONE_PUBLISHED = {
    "github": "GitHub publishes no Python library that signs deliveries",
    "shopify": "Shopify publishes no Python library that signs webhooks",
    "generic-hmac": "a generic HMAC scheme has no provider library",
}


def provider_signer(scheme: str, secret: str) -> ProviderSigner | str:
    """The provider library's signer for ``scheme``, or why there is none here."""
    if scheme in NONE_PUBLISHED:
        return NONE_PUBLISHED[scheme]
    module, package = LIBRARIES[scheme]
    if importlib.util.find_spec(module) is None:
        return f"the provider's library is not installed: pip install {package}"
    library: Any = importlib.import_module(module)
    if scheme == "standard-webhooks":

        def standard(body: bytes, event_id: str, moment: datetime) -> dict[str, str]:
            signature = library.Webhook(secret).sign(event_id, moment, body.decode())
            return {
                "webhook-id": event_id,
                "webhook-timestamp": str(int(moment.timestamp())),
                "webhook-signature": signature,
            }

        return ProviderSigner(package, standard)
    if scheme == "stripe":

        def stripe(body: bytes, event_id: str, moment: datetime) -> dict[str, str]:
            header = library.WebhookSignature.generate_signature_header(
                body.decode(), secret, int(moment.timestamp())
            )
            return {"stripe-signature": header}

        return ProviderSigner(package, stripe)
    verifier = importlib.import_module("slack_sdk.signature").SignatureVerifier(secret)

    def slack(body: bytes, event_id: str, moment: datetime) -> dict[str, str]:
        timestamp = str(int(moment.timestamp()))
        return {
            "x-slack-request-timestamp": timestamp,
            "x-slack-signature": verifier.generate_signature(timestamp=timestamp, body=body),
        }

    return ProviderSigner(package, slack)
