"""The dashboard in a real headless Chromium (Debian's, driven by Playwright): a tenant enters its key once,
sees its own runs, checkpoints and sessions, the live queue depth, its sampling, and the curves of a run it
trained; a long session name does not widen the page past a 1280-px window."""

import subprocess
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from tinker import types

from support.live_server import REPO_ROOT, LiveServer
from support.raw_run import RawRun
from support.sdk import SENTENCES, supervised_datum

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"]
NUM_STEPS = 3
NUM_SAMPLES = 3
LONG_NAME = "/home/someone/experiments/" + "vlm-classifier-caltech101-" * 12 + "run"  # the cookbook's log path
# Playwright's waits (5 s for expect, 30 s for actions by default) are hang guards here, not margins:
# a loaded machine may take longer.
expect.set_options(timeout=60_000)


@pytest.fixture(scope="module")
def browser() -> Browser:
    installed = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install_browser.sh")], capture_output=True,
                               text=True)
    if installed.returncode != 0:
        pytest.fail(f"no Chromium for the browser test:\n{installed.stderr[-3000:]}", pytrace=False)
    chromium = installed.stdout.strip().splitlines()[-1]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def trained(first_start_server: LiveServer) -> dict:
    """Tenant dash-a trains a run for NUM_STEPS steps and saves it with a 2-hour TTL; tenant dash-b has a run
    whose request waits behind a missing seq_id (a queue depth of 1 that stays while the test looks)."""
    key_a, key_b = first_start_server.create_key("dash-a"), first_start_server.create_key("dash-b")
    service = first_start_server.service_client(key_a)
    training = service.create_lora_training_client(base_model="builtin:tiny-qwen2-vl", rank=4).result()
    tokenizer = training.get_tokenizer()
    data = [supervised_datum(tokenizer, text) for text in SENTENCES[:2]]
    losses = []
    for _ in range(NUM_STEPS):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    checkpoint = training.save_state("dashboard", ttl_seconds=7200).result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    for _ in range(NUM_SAMPLES):
        sampler.sample(data[0].model_input, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    http_b = httpx.Client(base_url=first_start_server.url, headers=first_start_server.headers(key_b), timeout=60)
    assert http_b.post("/api/v1/create_session", json={"display_name": LONG_NAME}).status_code == 200
    waiting = RawRun(http_b, base_model="builtin:tiny-qwen2-vl")
    assert waiting.forward(waiting.forward_body(seq_id=2)).status_code == 200  # seq_id 1 never comes
    yield {"key_a": key_a, "key_b": key_b, "run_a": training.model_id, "run_b": waiting.model_id,
           "losses": losses, "checkpoint": checkpoint}
    http_b.close()
    service.holder.close()


def open_dashboard(browser: Browser, url: str, key: str) -> tuple[Page, list]:
    page = browser.new_page()
    page.set_default_timeout(60_000)
    requests = []
    page.on("request", lambda request: requests.append((request.url, request.headers.get("x-api-key"))))
    page.goto(f"{url}/dashboard")
    page.fill("#api-key", key)
    page.click("button[type=submit]")
    return page, requests


def test_a_tenant_sees_the_curves_of_its_run_with_the_losses_it_was_told(browser, first_start_server, trained):
    page, requests = open_dashboard(browser, first_start_server.url, trained["key_a"])
    loss = page.locator("figure[data-metric='loss:sum']")
    expect(loss).to_have_attribute("data-points", str(NUM_STEPS))
    shown = [float(title.split(": ")[1]) for title in loss.locator("circle title").all_text_contents()]
    assert shown == pytest.approx(trained["losses"], rel=1e-5)
    assert loss.locator("polyline").get_attribute("points").count(",") == NUM_STEPS
    for metric in ("grad_norm:mean", "learning_rate:mean"):
        expect(page.locator(f"figure[data-metric='{metric}']")).to_have_attribute("data-points", str(NUM_STEPS))
    expect(page.locator("#curves-title")).to_contain_text(f"{trained['run_a']} ({NUM_STEPS} steps)")

    # Its checkpoint with size and TTL, its session, its run; nothing of the other tenant.
    checkpoint = page.locator("#checkpoints tbody tr", has_text=trained["checkpoint"])
    expect(checkpoint).to_contain_text("KiB")
    expect(checkpoint).to_contain_text("in 1 h")
    expect(page.locator("#sessions tbody tr")).to_have_count(1)
    expect(page.locator("#tenant")).to_have_text("dash-a")
    assert trained["run_b"] not in page.content()
    expect(page.locator("#sampling")).to_contain_text(f"{NUM_SAMPLES} requests")
    expect(page.locator("#sampling")).to_contain_text("0 in flight")
    # Axis labels stay short whatever the scale (a learning rate of 1e-4 read ".0001000", clipped).
    assert page.evaluate("() => [number(0.0001), number(2.5e-7), number(123456), number(0.5)]") == \
        ["1.00e-4", "2.50e-7", "1.23e+5", "0.5"]

    # The key went as a header only: never in a URL, never in localStorage.
    key = trained["key_a"]
    assert all(key not in url for url, _ in requests)
    assert {header for url, header in requests if "/api/v1/" in url} == {key}
    assert page.evaluate("() => Object.keys(localStorage).length") == 0
    page.close()


def test_the_queue_depth_of_a_waiting_request_shows_live_for_its_tenant_only(browser, first_start_server, trained):
    page, _ = open_dashboard(browser, first_start_server.url, trained["key_b"])
    expect(page.locator("#queue-depth")).to_have_text("1")
    row = page.locator(f"#runs tbody tr[data-model-id='{trained['run_b']}']")
    expect(row.locator("td").nth(4)).to_have_text("1")
    expect(page.locator("#curves-note")).to_contain_text("No training step recorded yet")
    assert trained["run_a"] not in page.content()
    expect(page.locator("#sampling")).to_contain_text("0 requests")  # the other tenant's are not counted here
    # A long session name is cut in its cell (whole in the tooltip), not the page widened.
    name = page.locator("#sessions td", has_text="vlm-classifier")
    expect(name).to_have_attribute("title", LONG_NAME)
    assert page.evaluate("() => document.documentElement.scrollWidth") <= page.viewport_size["width"] == 1280
    page.close()


def test_a_wrong_key_is_refused_and_shows_nothing(browser, first_start_server, trained):
    page, _ = open_dashboard(browser, first_start_server.url, "tml-not-a-key")
    expect(page.locator("#status")).to_contain_text("refused")
    expect(page.locator("#content")).to_be_hidden()
    page.close()


def test_the_dashboard_api_answers_only_with_a_key_and_only_for_the_callers_runs(first_start_server, trained):
    url = first_start_server.url
    assert httpx.get(f"{url}/api/v1/dashboard/overview").status_code == 401
    assert httpx.get(f"{url}/dashboard").status_code == 200  # the page holds no data
    other = httpx.get(f"{url}/api/v1/dashboard/runs/{trained['run_a']}/curves",
                      headers=first_start_server.headers(trained["key_b"]))
    assert other.status_code == 404
