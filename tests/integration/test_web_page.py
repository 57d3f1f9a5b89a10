"""The web page in a real Chromium against a real `hybridllm serve` of the embedded model: chat
that streams, stops, regenerates, edits and survives a reload; the placement picture; the live
plots while `bench serve` runs; and the failures a page meets, each shown as a clear message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.integration.browser import close_browser, launch_browser, screenshot
from tests.integration.openai_server import REPO_ROOT, RemoteServer
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

API_KEY = "page-test-key"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def browser():
    playwright, chromium = launch_browser()
    yield chromium
    close_browser(playwright, chromium)


@pytest.fixture(scope="module")
def server():
    args = ["--max-model-len", "1024", "--max-num-seqs", "8", "--tool-call-parser", "hermes"]
    with RemoteServer(args) as srv:
        yield srv


def open_page(browser, root: str):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    page.errors = []  # uncaught script errors fail the test that met them
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.goto(f"{root}/")
    return page


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server.root)
    yield page
    errors = page.errors
    page.context.close()
    assert not errors, errors


def sampling(page, **fields) -> None:
    """Fill the chat's sampling fields (ids as in index.html: max-tokens, top-p, ...)."""
    if page.locator("#chat-settings").get_attribute("open") is None:
        page.click("#chat-settings summary")
    for name, value in fields.items():
        selector = f"#{name.replace('_', '-')}"
        if name == "tool_choice":
            page.select_option(selector, value)
        else:
            page.fill(selector, str(value))


def send(page, text: str):
    """Send `text` from the composer; returns the chat request's JSON body."""
    with page.expect_request("**/v1/chat/completions") as request:
        page.fill("#input", text)
        page.click("#send")
    return request.value.post_data_json


def wait_idle(page, timeout_s: float = 120) -> None:
    page.wait_for_selector("#send:not([hidden])", timeout=timeout_s * 1000)


def reply_text(page) -> str:
    replies = page.locator(".message.assistant .content")
    return replies.last.inner_text() if replies.count() else ""


def test_chat_streams_token_by_token_and_survives_a_reload(page, server):
    sampling(page, temperature=0, max_tokens=40)
    page.evaluate(
        """() => {
          window.replyLengths = [];
          new MutationObserver(() => {
            const r = [...document.querySelectorAll('.message.assistant .content')].pop();
            if (r) window.replyLengths.push(r.textContent.length);
          }).observe(document.getElementById('messages'), {childList: true, subtree: true});
        }"""
    )
    body = send(page, "Name three colours of the rainbow.")
    assert body["temperature"] == 0 and body["max_tokens"] == 40 and body["stream"] is True
    assert body["messages"] == [{"role": "user", "content": "Name three colours of the rainbow."}]
    wait_idle(page)
    lengths = page.evaluate("window.replyLengths")
    growing = sorted(set(lengths))
    assert len(growing) >= 5, f"the reply did not arrive in pieces: {lengths}"
    assert lengths == sorted(lengths), f"the reply shrank while streaming: {lengths}"
    # The page shows what the server generates: the same request, not streamed.
    expected = (
        server.client()
        .chat.completions.create(
            model=body["model"], messages=body["messages"], temperature=0, max_tokens=40
        )
        .choices[0]
        .message.content
    )
    shown = page.locator(".message.assistant .content").last.text_content()
    assert " ".join(shown.split()) == " ".join(expected.split())

    # a changed temperature is what the next request carries
    sampling(page, temperature=0.25, seed=7)
    body = send(page, "And three more.")
    assert body["temperature"] == 0.25 and body["seed"] == 7
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    wait_idle(page)
    screenshot(page, "chat")

    page.reload()
    page.wait_for_selector(".message.assistant")
    assert page.locator(".message.user .content").all_inner_texts() == [
        "Name three colours of the rainbow.",
        "And three more.",
    ]
    assert "Name three colours" in page.locator("#conversation-list li").first.inner_text()
    assert page.input_value("#temperature") == "0.25"  # the settings were kept too


def test_stop_ends_the_generation_on_the_server(page, server):
    sampling(page, temperature=0.8, max_tokens=900)
    send(page, "Tell me a very long story about a lighthouse keeper.")
    wait_until(lambda: len(reply_text(page)) > 20, 60, "no reply text arrived")
    page.click("#stop")
    wait_idle(page, 10)
    assert page.locator(".message.assistant .note").last.inner_text() == "stopped"
    stopped_at = reply_text(page)
    wait_until(
        lambda: server.metrics()["hybridllm:num_requests_running"] == 0,
        30,
        "the server still runs the stopped request",
    )
    time.sleep(0.5)
    assert reply_text(page) == stopped_at  # nothing arrives after the stop


def test_regenerate_and_edit_resend(page):
    sampling(page, temperature=0, max_tokens=8)
    send(page, "Hi")
    wait_idle(page)
    with page.expect_request("**/v1/chat/completions") as request:
        page.click(".message.assistant .actions button:has-text('Regenerate')")
    # the old reply is not sent back: it is what the new one replaces
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "Hi"}]
    wait_idle(page)
    assert page.locator(".message").count() == 2

    page.click(".message.user .actions button:has-text('Edit')")
    page.fill(".message.user textarea", "Hello there")
    with page.expect_request("**/v1/chat/completions") as request:
        page.click(".message.user .actions button:has-text('Send')")
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "Hello there"}]
    wait_idle(page)
    assert page.locator(".message").count() == 2
    assert page.locator(".message.user .content").inner_text() == "Hello there"


def test_tool_calls_are_shown_as_calls(page):
    sampling(page, temperature=0, max_tokens=64, tools=json.dumps([WEATHER_TOOL]))
    sampling(page, tool_choice="required")
    body = send(page, "What is the weather in Paris?")
    assert body["tool_choice"] == "required" and body["tools"] == [WEATHER_TOOL]
    wait_idle(page)
    call = page.locator(".message.assistant .tool-call").first
    assert call.locator("div").first.inner_text() == "Tool call: get_weather"
    arguments = json.loads(call.locator("pre").inner_text())
    assert isinstance(arguments.get("city"), str)
    screenshot(page, "tool-call")


def test_server_errors_are_shown_as_the_server_said_them(page, server):
    sampling(page, max_tokens=100_000_000)
    body = send(page, "Hi")
    wait_idle(page)
    error = page.locator(".message.assistant .error").last.inner_text()
    direct = server.client().with_options(max_retries=0)
    with pytest.raises(Exception) as raised:
        direct.chat.completions.create(
            model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"]
        )
    assert error == f"400: {raised.value.body['message']}"
    assert "maximum context length" in error
    # a field that is not JSON is the page's own error, and nothing is sent
    sampling(page, max_tokens=4, tools="[{not json")
    page.fill("#input", "Hi again")
    page.click("#send")
    assert "The tools field is not JSON" in page.locator("#banner-text").inner_text()
    assert page.locator(".message.user").count() == 1  # nothing was added or sent
    assert page.input_value("#input") == "Hi again"  # the text is kept to send again
    # the page goes on working
    sampling(page, tools="")
    send(page, "Hi again")
    assert page.locator(".message.user").count() == 2
    wait_idle(page)
    assert page.locator(".message.assistant").last.locator(".error").count() == 0
    screenshot(page, "errors")


def test_placement_lists_the_layers_on_the_cpu(page):
    page.click("[data-tab=placement]")
    page.wait_for_selector("#plan-picture svg")
    cells = page.locator("#plan-picture svg .layer")
    assert cells.count() == 30  # SmolLM2-135M's 30 layers, all on the one CPU worker
    assert page.locator("#plan-picture svg .layer.cpu").count() == 30
    text = page.locator("#plan-text").text_content()
    assert "layers [0, 30)" in text and "rank 0: cpu" in text
    picture = page.locator("#plan-picture svg").text_content()
    assert "cpu" in picture
    screenshot(page, "placement")


def test_live_plots_move_while_bench_serve_runs(page, server):
    from hybridllm.loader import default_model_path

    page.click("[data-tab=live]")
    generated = page.locator("polyline[data-series=generation_tokens_per_s]")
    generated.wait_for()
    cmd = [
        sys.executable, "-m", "hybridllm", "bench", "serve", "--base-url", server.root,
        "--tokenizer", default_model_path(), "--endpoint", "/v1/chat/completions",
        "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "48",
        "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    bench = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def peak(series: str) -> float:
            line = page.locator(f"polyline[data-series={series}]")
            return float(line.get_attribute("data-max") or 0)

        wait_until(lambda: peak("generation_tokens_per_s") > 0, 90, "no generated tokens plotted")
        wait_until(lambda: peak("running") >= 2, 90, "never two requests running at once")
        wait_until(lambda: peak("ttft_p50_s") > 0, 90, "no time to first token plotted")
        screenshot(page, "live")
        output, _ = bench.communicate(timeout=180)
    finally:
        bench.kill()
    assert bench.returncode == 0, output
    assert peak("itl_p50_s") > 0 and peak("prompt_tokens_per_s") > 0


def test_failures_are_clear_and_the_page_stays_usable(browser):
    # A server of its own: it wants a key, splits reasoning out, and is killed mid-reply.
    args = ["--api-key", API_KEY, "--reasoning-parser", "deepseek_r1", "--max-model-len", "1024"]
    with RemoteServer(args) as server:
        page = open_page(browser, server.root)
        try:
            page.wait_for_selector("#banner:not([hidden])")
            assert "401" in page.locator("#banner-text").inner_text()
            assert "API key" in page.locator("#banner-text").inner_text()
            sampling(page, temperature=0, max_tokens=12)
            send(page, "Hi")
            wait_idle(page)
            error = page.locator(".message.assistant .error").last.inner_text()
            assert error.startswith("401:") and "under Settings" in error
            screenshot(page, "401")

            page.click("[data-tab=settings]")
            page.fill("#api-key", API_KEY)
            page.press("#api-key", "Tab")  # the change event: the page asks again, with the key
            page.wait_for_selector("#banner", state="hidden")
            page.click("[data-tab=chat]")
            send(page, "Hi")
            wait_idle(page)
            # deepseek_r1 reads the whole reply as reasoning: it is shown folded
            reasoning = page.locator(".message.assistant").last.locator("details.reasoning")
            assert reasoning.count() == 1 and reasoning.get_attribute("open") is None
            assert reasoning.locator("div").text_content().strip()

            sampling(page, max_tokens=800)
            send(page, "Tell me a long story.")
            last = page.locator(".message.assistant").last
            wait_until(lambda: len(last.text_content()) > 40, 60, "no reply text before the kill")
            server.proc.kill()  # the server dies mid-stream
            wait_idle(page, 30)
            error = last.locator(".error").inner_text()
            assert "connection dropped" in error
            send(page, "Are you there?")
            wait_idle(page, 30)
            error = page.locator(".message.assistant").last.locator(".error").inner_text()
            assert error.startswith("Cannot reach the server")
            assert page.locator("#input").is_enabled() and page.locator("#send").is_visible()
            screenshot(page, "unreachable")
        finally:
            errors = page.errors
            page.context.close()
        assert not errors, errors


def test_stored_replies_render_code_as_code_and_markup_as_text(page):
    hostile = (
        '<img src=x onerror="window.pwned=1"> see ```python\nprint("<b>hi</b>")\n``` and `x<y`'
    )
    conversation = {
        "id": "c1",
        "title": "<b>title</b>",
        "messages": [
            {"role": "user", "content": "show me code"},
            {
                "role": "assistant",
                "content": hostile,
                "reasoning": "<script>window.pwned=2</script>",
            },
        ],
    }
    page.evaluate(
        "c => localStorage.setItem('hybridllm.conversations', JSON.stringify([c]))", conversation
    )
    page.reload()
    reply = page.locator(".message.assistant")
    reply.wait_for()
    assert reply.locator("img, script, b").count() == 0  # markup stays text
    code = reply.locator("pre code")
    assert code.get_attribute("data-lang") == "python"
    assert code.text_content() == 'print("<b>hi</b>")\n'
    assert reply.locator("p code").text_content() == "x<y"
    assert (
        reply.locator("details.reasoning div").text_content() == "<script>window.pwned=2</script>"
    )
    assert page.locator("#conversation-list li span").text_content() == "<b>title</b>"
    assert page.evaluate("window.pwned") is None
