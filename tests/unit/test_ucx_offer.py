"""transports.ucx.UcxOffer: what a UCX peer must present for a standing grant (pure, no UCX loaded)."""

from __future__ import annotations

from transports.ucx import SECRET_BYTES, UcxOffer


def test_only_the_secret_itself_proves_reach() -> None:
    secret = bytes(range(SECRET_BYTES))
    offer = UcxOffer(b"\x01\x02", secret, 0x1000, b"\xaa\xbb")
    assert offer.wire == {"address": "0102", "secret": [0x1000, "aabb"]}  # where to read it, never the secret
    assert offer.proves_reach(secret.hex())
    assert not offer.proves_reach("")
    assert not offer.proves_reach("00" * SECRET_BYTES)
    assert not offer.proves_reach(secret.hex()[:-2])


def test_an_offer_without_a_secret_grants_no_lease() -> None:
    offer = UcxOffer(b"\x01")
    assert offer.wire == {"address": "01"}
    assert not offer.proves_reach("")
    assert not offer.proves_reach("00" * SECRET_BYTES)
