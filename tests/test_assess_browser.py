# Renders tn's HTML pages (tn assess report, prof.save_html) in headless Chromium: no console message, content present.
import os
import re
import shutil
import subprocess

import pytest
import torch

import tn

pytest.importorskip("plotly", reason="HTML reports need plotly: pip install 'tn[report]'")
pytest.importorskip("jinja2", reason="HTML reports need jinja2: pip install 'tn[report]'")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package for headless rendering "
                                                          "(apt-get install chromium; CI installs it)")


def _chromium(page, *extra):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--window-size=1400,2400", *extra,
           f"file://{page}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _render(page, screenshot):
    """(DOM after scripts ran, console messages, network requests of other schemes) and a screenshot."""
    p = _chromium(page, "--dump-dom")
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    shot = _chromium(page, f"--screenshot={screenshot}")
    assert os.path.exists(screenshot) and os.path.getsize(screenshot) > 10_000, shot.stderr[-2000:]
    return p.stdout, console


def _check_plot(dom, section):
    # plotly turns each figure's div into SVG layers (class main-svg) with one path per bar
    m = re.search(rf'id="{section}"(.*?)</div>\s*</div>\s*</div>', dom, re.S)
    assert m is not None, f"no {section} in the rendered page"
    assert "main-svg" in dom[m.start():m.start() + 2_000_000]


def test_assessment_page_renders_in_chromium(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    res = tn.assess(model, (torch.randn(64, 64),), doors=("eager", "jit"), progress=False, repeats=1)
    assert res.ok
    page = str(tmp_path / "report.html")
    res.save_html(page)
    text = open(page).read()
    assert not re.search(r'<(script|link)[^>]+(src|href)="https?:', text), "the page must not load from the network"
    dom, console = _render(page, str(tmp_path / "report.png"))
    assert console == [], console
    for ident in ('id="verdicts"', 'id="doors"', 'id="host-ops"', 'id="timeline-section"', 'id="modules-section"'):
        assert ident in dom
    _check_plot(dom, "timeline-section")
    _check_plot(dom, "modules-section")
    assert "TensorE" in dom and "every requested door ran and matched the CPU" in dom


def test_profile_save_html_renders_in_chromium(tmp_path):
    f = tn.jit(lambda a, b: torch.softmax(a @ b, dim=-1))
    with tn.profile() as prof:
        f(torch.randn(128, 256), torch.randn(256, 512))
    page = prof.save_html(tmp_path / "profile.html")
    dom, console = _render(page, str(tmp_path / "profile.png"))
    assert console == [], console
    assert 'id="programs"' in dom and 'id="opcodes"' in dom and 'id="host-ops"' in dom
    _check_plot(dom, "timeline-section")
    assert "matmul" in dom
