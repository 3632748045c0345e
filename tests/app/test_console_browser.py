"""The console in a real Chromium against a live gateway: the admin's whole day, in one browser session.

Sign in (a non-admin key refused), create a tenant by keyboard and a key (its secret shown once), upload an
adapter by drag and drop (the validation error shown inline) and by the file picker, send requests with
the `openai` client, see them on the usage chart and in the CSV, revoke the key and see the next request
refused, a forged form refused, sign out. Screenshots of each page at phone and desktop width.
"""

from __future__ import annotations

import base64
import csv
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from playwright.sync_api import BrowserContext, Page, expect

from tests.app.browser import chromium, screenshot_dir, shoot
from tests.app.gateway_fixtures import make_tenant
from tests.app.live_server import LiveServer

pytestmark = pytest.mark.default_model

# Playwright's defaults (30 s for actions, 5 s for expectations) are for an idle machine; a CI box running the
# engine's tests beside the browser can be many times slower, and a pass is never slower for a longer wait.
LOADED_MACHINE_TIMEOUT_MS = 90_000
HOSTILE_KEY_NAME = "<script>window.__owned = 1</script>"


@pytest.fixture
def browser(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    """Chromium, started after the live server: the server's fixtures (the engine, the emptied database) call
    asyncio.run(), which cannot run while Playwright's synchronous API holds this thread's event loop."""
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


@pytest.fixture
def page(browser: BrowserContext) -> Iterator[Page]:
    page = browser.new_page()
    page.set_default_timeout(LOADED_MACHINE_TIMEOUT_MS)
    expect.set_options(timeout=LOADED_MACHINE_TIMEOUT_MS)
    page.on("dialog", lambda dialog: pytest.fail(f"a script ran: dialog {dialog.message!r}"))
    yield page
    page.close()


def sign_in(page: Page, server: LiveServer, key: str) -> None:
    page.goto(f"{server.url}/console")
    expect(page).to_have_url(f"{server.url}/console/sign-in")
    page.get_by_label("Admin API key").fill(key)
    page.get_by_role("button", name="Sign in").click()


def drop_files(page: Page, files: dict[str, bytes]) -> None:
    """Drop ``files`` (name: bytes) on the adapter drop zone as a drag from the desktop would."""
    encoded = {name: base64.b64encode(data).decode() for name, data in files.items()}
    page.evaluate(
        """(files) => {
            const transfer = new DataTransfer();
            for (const [name, b64] of Object.entries(files)) {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                transfer.items.add(new File([bytes], name));
            }
            const zone = document.getElementById("drop");
            zone.dispatchEvent(new DragEvent("dragover", {dataTransfer: transfer, bubbles: true, cancelable: true}));
            zone.dispatchEvent(new DragEvent("drop", {dataTransfer: transfer, bubbles: true, cancelable: true}));
        }""",
        encoded,
    )


def test_the_admin_console_in_a_real_browser(
    server: LiveServer, page: Page, tenant_adapters, default_engine, tmp_path_factory
) -> None:
    shots = screenshot_dir(tmp_path_factory)
    admin = server.run(make_tenant(server.gateway, "admin", scopes=("admin",)))
    user = server.run(make_tenant(server.gateway, "someone"))

    # A key without the admin scope is refused at sign-in, in words.
    sign_in(page, server, user.key)
    expect(page.get_by_role("alert")).to_contain_text("lacks the `admin` or `tenant-admin` scope")
    shoot(page, shots, "sign-in")
    sign_in(page, server, admin.key)
    expect(page).to_have_url(f"{server.url}/console/tenants")

    # Keyboard: the first Tab reaches the skip link; a tenant is created with the keyboard alone.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to the content"
    page.get_by_label("Name", exact=True).focus()
    page.keyboard.type("acme")
    page.get_by_label("Requests a minute").first.fill("600")
    page.keyboard.press("Enter")
    expect(page.get_by_role("status")).to_contain_text("Created the tenant acme")
    expect(page.get_by_role("heading", name="acme")).to_be_visible()
    tenant_url = page.url
    shoot(page, shots, "tenant")

    # A key: created, its secret shown once; a key named like a script is shown as text.
    page.get_by_role("link", name="API keys").click()
    expect(page.get_by_text("This tenant has no API keys yet")).to_be_visible()
    page.get_by_label("Name", exact=True).fill("backend")
    page.get_by_role("button", name="Create key").click()
    secret = page.get_by_test_id("new-secret").inner_text()
    assert secret.startswith("lpx_")
    page.get_by_label("Name", exact=True).fill(HOSTILE_KEY_NAME)
    page.get_by_role("button", name="Create key").click()
    expect(page.get_by_role("row", name=HOSTILE_KEY_NAME)).to_be_visible()
    assert page.evaluate("window.__owned") is None
    assert secret not in page.content()
    shoot(page, shots, "keys")

    # Adapters: a drop of files that are no adapter is refused inline; the real one is uploaded and pinned.
    page.get_by_role("link", name="Adapters").click()
    expect(page.get_by_text("This tenant has no adapters yet")).to_be_visible()
    page.get_by_label("Name (the model its keys will use)").fill("alpha")
    drop_files(page, {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": b"junk"})
    expect(page.locator("#chosen")).to_contain_text("adapter_config.json")
    page.get_by_role("button", name="Upload").click()
    expect(page.locator("#upload-result")).to_contain_text("Upload refused:")
    folder = Path(tenant_adapters["alpha"])
    page.locator("#adapter-files").set_input_files(
        [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
    )
    page.get_by_role("button", name="Upload").click()
    expect(page.get_by_role("status")).to_contain_text("Uploaded the adapter alpha")
    page.get_by_role("button", name="Pin alpha").click()
    expect(page.get_by_role("row", name="alpha")).to_contain_text("pinned in the pool")
    shoot(page, shots, "adapters")

    # Requests with the official client, on the adapter and on the base model.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0)
    for model in ("alpha", "alpha", default_engine.model_name):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert reply.usage.total_tokens > 0
    server.run(server.gateway.writer.flush())

    # The usage page: per key, a chart drawn and a row of three requests; the CSV holds the rows shown.
    page.goto(f"{server.url}/console/usage?group=key")
    expect(page.locator("#requests-chart .uplot")).to_be_visible()
    expect(page.locator("#tokens-chart canvas")).to_be_visible()
    row = page.locator("#usage-table").get_by_role("row", name="backend")
    expect(row).to_contain_text("acme")
    assert row.locator("td").nth(2).inner_text() == "3"
    shown_rows = page.locator("#usage-table tbody tr").count()
    with page.expect_download() as download_info:
        page.locator("#csv-link").click()
    lines = list(csv.DictReader(io.StringIO(Path(download_info.value.path()).read_text())))
    assert len(lines) == shown_rows
    backend = next(line for line in lines if line["group"].startswith("backend"))
    assert backend["tenant"] == "acme" and backend["requests"] == "3" and int(backend["completion_tokens"]) > 0
    shoot(page, shots, "usage")

    # Revoking the key refuses its next request.
    page.goto(f"{tenant_url}/keys")
    page.get_by_role("row", name="backend").get_by_role("button", name="Revoke").click()
    expect(page.get_by_role("status")).to_contain_text("Revoked the key backend")
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

    # The audit log names the revocation; the filter keeps only it.
    page.goto(f"{server.url}/console/audit")
    page.get_by_label("Action").select_option("key.revoke")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("ol.audit > li")).to_have_count(1)
    expect(page.locator("ol.audit > li")).to_contain_text("key.revoke")
    page.goto(f"{server.url}/console/audit")
    shoot(page, shots, "audit")

    page.goto(f"{server.url}/console/engine")
    expect(page.get_by_role("heading", name="Worker")).to_be_visible()
    expect(page.get_by_role("row", name="Adapters")).to_be_visible()
    shoot(page, shots, "engine")
    page.goto(f"{server.url}/console/tenants")
    shoot(page, shots, "tenants")

    # A form posted without the session's token, and one posted from another site, change nothing.
    status = page.evaluate(
        """async () => {
            const body = new URLSearchParams({name: "forged"});
            return (await fetch("/console/tenants", {method: "POST", body: body})).status;
        }"""
    )
    assert status == 403
    other_site = server.url.replace("127.0.0.1", "localhost")
    page.goto(f"{other_site}/health")
    page.evaluate(
        """(target) => {
            const form = document.createElement("form");
            form.method = "post"; form.action = target;
            const name = document.createElement("input"); name.name = "name"; name.value = "cross-site";
            form.appendChild(name); document.body.appendChild(form); form.submit();
        }""",
        f"{server.url}/console/tenants",
    )
    page.wait_for_url(f"{server.url}/console/sign-in")  # the cookie stayed home: no session came with the post
    page.goto(f"{server.url}/console/tenants")
    expect(page.get_by_role("row", name="acme")).to_be_visible()
    expect(page.get_by_text("forged")).to_have_count(0)
    expect(page.get_by_text("cross-site")).to_have_count(0)

    # Deleting needs the name typed back; signing out ends the session.
    page.goto(tenant_url)
    page.get_by_role("link", name="Delete tenant…").click()
    page.get_by_label("Type acme to confirm").fill("acm")
    page.get_by_role("button", name="Delete tenant").click()
    expect(page.get_by_role("alert")).to_contain_text("Type the tenant's name, acme, to confirm")
    page.get_by_label("Type acme to confirm").fill("acme")
    page.get_by_role("button", name="Delete tenant").click()
    expect(page.get_by_role("status")).to_contain_text("Deleted the tenant acme")
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_text("You are signed out.")).to_be_visible()
    page.goto(f"{server.url}/console/usage")
    expect(page).to_have_url(f"{server.url}/console/sign-in")
