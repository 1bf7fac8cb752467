"""API keys, tenants and the tenant cache salt."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import UnauthenticatedError
from common.kv.hashing import hash_prompt_blocks
from services.gateway.auth import ApiKeys, key_tenant, parse_keys_file, tenant_cache_salt


def test_keys_from_flags_and_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# key tenant\nk-alpha  alpha\n\nk-beta beta # the second\nk-lone\n")
    keys = ApiKeys.load(["k-flag"], str(keys_file))
    assert keys is not None
    assert keys.tenant_of([("authorization", "Bearer k-alpha")]) == "alpha"
    assert keys.tenant_of([("authorization", "bearer  k-beta ")]) == "beta"
    assert keys.tenant_of([("authorization", "Bearer k-lone")]) == key_tenant("k-lone")
    assert keys.tenant_of([("x", "y"), ("authorization", "Bearer k-flag")]) == key_tenant("k-flag")
    assert key_tenant("k-flag").startswith("key-") and "k-flag" not in key_tenant("k-flag")
    assert ApiKeys.load([], None) is None


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ([], "requires an API key"),
        ([("authorization", "Basic abc")], "Bearer <key>"),
        ([("authorization", "Bearer")], "Bearer <key>"),
        ([("authorization", "Bearer wrong")], "not valid"),
    ],
)
def test_missing_or_wrong_keys_are_unauthenticated(
    metadata: list[tuple[str, str]], message: str
) -> None:
    keys = ApiKeys.load(["right"])
    assert keys is not None
    with pytest.raises(UnauthenticatedError, match=message):
        keys.tenant_of(metadata)


def test_a_bad_keys_file_line_is_refused() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_keys_file("a b\nc d e\n")


def test_tenant_salts_are_injective_and_isolate_tenants() -> None:
    assert tenant_cache_salt(None, "") is None
    assert tenant_cache_salt(None, "s") == "s"
    salts = {
        tenant_cache_salt(tenant, client)
        for tenant, client in [
            ("a", ""), ("a", "x"), ("b", ""), ("b", "x"), ("a,b", ""), ("a", ",b"),
            ('a"', ""), ("a", '"'),
        ]
    }  # fmt: skip
    assert len(salts) == 8
    # A client salt that spells out another tenant's derived salt reaches nothing of it.
    forged = tenant_cache_salt("b", "")
    assert forged is not None
    assert tenant_cache_salt("a", forged) != forged
    tokens = list(range(32))
    a_blocks = hash_prompt_blocks(tokens, 16, tenant_cache_salt("a", ""))
    assert hash_prompt_blocks(tokens, 16, tenant_cache_salt("b", "")) != a_blocks
    assert hash_prompt_blocks(tokens, 16, None) != a_blocks
    assert hash_prompt_blocks(tokens, 16, tenant_cache_salt("a", "")) == a_blocks


class _Call:
    def __init__(self, key: str | None) -> None:
        self.metadata = [("authorization", f"Bearer {key}")] if key else []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata


def test_only_an_admin_tenants_key_may_change_roles(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from common.errors import PermissionDeniedError
    from services.gateway.admin import AdminServicer

    keys_file = tmp_path / "keys"
    keys_file.write_text("user-key alice\nops-key ops\n")
    keys = ApiKeys.load([], str(keys_file))
    admin = AdminServicer(
        SimpleNamespace(config=SimpleNamespace(api_keys=keys)),  # type: ignore[arg-type]
        frozenset({"ops"}),
    )
    admin._check_admin(_Call("ops-key"))  # type: ignore[arg-type]
    with pytest.raises(PermissionDeniedError, match="'alice' may not change the cluster"):
        admin._check_admin(_Call("user-key"))  # type: ignore[arg-type]
    with pytest.raises(UnauthenticatedError):
        admin._check_admin(_Call(None))  # type: ignore[arg-type]
    # Without keys the gateway is open, AdminService too.
    open_admin = AdminServicer(
        SimpleNamespace(config=SimpleNamespace(api_keys=None)),  # type: ignore[arg-type]
        frozenset(),
    )
    open_admin._check_admin(_Call(None))  # type: ignore[arg-type]
