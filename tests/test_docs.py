"""The README is a front door and docs/ holds the depth: every relative link and #anchor in README.md and
docs/*.md resolves, the README stays at most 250 lines and opens with the main job's and the tests' commands,
and docs/configuration.md's Config table lists every field of ``layerckpt.Config`` and no other."""
import dataclasses
import glob
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
COMMANDS = [
    'pip install torch==2.13.0 && pip install ".[lightning]" && python examples/lightning_finetune.py   # main job',
    'pip install torch==2.13.0 && pip install ".[test]" && python -m pytest -q tests        # tests',
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose(text: str):
    """The lines outside fenced code blocks, with inline code blanked."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield re.sub(r"`[^`]*`", "``", line)


def _anchors(path: str) -> set:
    """The #anchors GitHub gives a file's headings: lower case, punctuation but '-' and '_' dropped, spaces as
    '-', a repeated one suffixed -1, -2, ..."""
    seen, out = {}, set()
    for line in _prose(_read(path).replace("`", "")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in PAGES:
        fences = sum(line.lstrip().startswith("```") for line in _read(page).splitlines())
        if fences % 2:
            bad.append(f"{os.path.relpath(page, ROOT)}: a code fence left open")
        for line in _prose(_read(page)):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                where = f"{os.path.relpath(page, ROOT)}: {target}"
                if not os.path.exists(dest):
                    bad.append(f"{where} (no such file)")
                elif anchor and (not dest.endswith(".md") or anchor not in _anchors(dest)):
                    bad.append(f"{where} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_is_a_front_door():
    text = _read(README)
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S).group(1).splitlines()
    assert block == COMMANDS, block
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        test_cmd = re.search(r"^TEST_CMD='([^']*)'", f.read(), re.M).group(1)
    assert test_cmd in block[1]  # .ci/run greps the README for it


def test_config_table_lists_every_field():
    import layerckpt

    rows = []
    for line in _read(os.path.join(ROOT, "docs", "configuration.md")).splitlines():
        m = re.match(r"\|\s*`(\w+)`\s*\|", line)
        if m:
            rows.append(m.group(1))
    fields = [f.name for f in dataclasses.fields(layerckpt.Config)]
    assert sorted(rows) == sorted(fields), (sorted(set(fields) - set(rows)), sorted(set(rows) - set(fields)))


def test_measured_tables_match_their_json(capsys):
    """Every table between `<!-- table: benchmarks/NAME.json -->` markers is what its JSON renders
    (`python -m layerckpt.bench.report --write` rewrites them after a re-run)."""
    from layerckpt.bench import report

    assert report.main(["--check", "--root", ROOT]) == 0, capsys.readouterr().err
    differ, broken, count = report.run(ROOT, write=False)
    assert count >= 10 and not differ and not broken


def test_a_table_edited_by_hand_fails_the_check(tmp_path, capsys):
    import shutil

    from layerckpt.bench import report

    for name in ("README.md", "docs", "benchmarks"):
        src = os.path.join(ROOT, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, str(tmp_path / name))
    page = tmp_path / "docs" / "sharded.md"
    text = page.read_text(encoding="utf-8")
    start = text.index("<!-- table: benchmarks/gpt2-small-sharded-2rank-2core.json")
    line = "layerckpt full               0.174 [0.173-0.180]"
    assert text.index(line, start) < text.index("<!-- /table -->", start)
    page.write_text(text.replace(line, line.replace("0.174", "0.147"), 1), encoding="utf-8")
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/sharded.md" in capsys.readouterr().err and "gpt2-small-sharded-2rank-2core.json" in \
        "\n".join(report.run(str(tmp_path), write=False)[0])
    # --write puts the JSON's number back, and the check passes again
    assert report.main(["--write", "--root", str(tmp_path)]) == 0
    assert page.read_text(encoding="utf-8") == text
    assert report.main(["--check", "--root", str(tmp_path)]) == 0
