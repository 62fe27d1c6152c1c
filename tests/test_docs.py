"""The README is a front door and docs/ holds the depth: every relative link and #anchor in README.md and
docs/*.md resolves, the README stays at most 250 lines and opens with the main job's and the tests' commands,
docs/configuration.md's Config table lists every field of ``layerckpt.Config`` and no other, every measured table
is what its JSON renders, and every JSON the pages cite records the clean commit that measured it."""
import dataclasses
import glob
import json
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
    marker = re.search(r"<!-- table: (benchmarks/[\w.-]+\.json) sharded -->", text)
    line = re.search(r"^layerckpt full +(\d+\.\d+) ", text[marker.end():], re.M)
    assert marker.end() + line.start() < text.index("<!-- /table -->", marker.end())
    edited = line.group(0).replace(line.group(1), f"{float(line.group(1)) + 0.1:.3f}")
    page.write_text(text.replace(line.group(0), edited, 1), encoding="utf-8")
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/sharded.md" in capsys.readouterr().err and marker.group(1) in \
        "\n".join(report.run(str(tmp_path), write=False)[0])
    # --write puts the JSON's number back, and the check passes again
    assert report.main(["--write", "--root", str(tmp_path)]) == 0
    assert page.read_text(encoding="utf-8") == text
    assert report.main(["--check", "--root", str(tmp_path)]) == 0


JSON_NAME = re.compile(r"(?<![\w.-])((?:benchmarks/)?[\w.-]+\.json)\b")
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")  # the pages name a commit in code quotes: `82bf916`
NAMED = re.compile(r"-([0-9a-f]{7,40})(?=[.-])")  # a commit in a JSON's file name: ...-82bf916.json


def _recorded(name: str):
    """The commit a bench's JSON records of the code that ran, and whether its tree had uncommitted changes:
    ``machine`` (``layerckpt.bench.machine``), or the top level of an older hand-written one."""
    with open(os.path.join(ROOT, "benchmarks", name), encoding="utf-8") as f:
        res = json.load(f)
    where = res["machine"] if isinstance(res.get("machine"), dict) else res
    return where.get("commit"), where.get("commit_dirty")


def _sentences(text: str):
    """``text`` cut after each '.', '!', '?' or ';' outside parentheses that a blank and a capital, a quote, '*',
    '(' or '[' follow."""
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth <= 0 and ch in ".!?;" and re.match(r"\s+[A-Z`*(\[]", text[i + 1:]):
            yield text[start:i + 1]
            start, depth = i + 1, 0
    yield text[start:]


def _units(text: str):
    """A page's smallest pieces of prose that say which run a figure comes from: the sentences (and
    ';'-separated clauses) of each paragraph, list item and table cell."""
    for para in re.split(r"\n\s*\n", text):
        for item in re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)|\n(?=\|)", para):
            for cell in item.split(" | "):
                yield from _sentences(cell)


def _cited():
    """(page, JSON name) of every file under benchmarks/ that README.md or docs/*.md name, and the names of
    'benchmarks/X.json' paths they give that do not exist."""
    cited, missing = [], []
    for page in PAGES:
        for ref in dict.fromkeys(JSON_NAME.findall(_read(page))):
            name = os.path.basename(ref)
            if os.path.exists(os.path.join(ROOT, "benchmarks", name)):
                cited.append((os.path.relpath(page, ROOT), name))
            elif ref.startswith("benchmarks/"):
                missing.append(f"{os.path.relpath(page, ROOT)}: {ref} (no such file)")
    return cited, missing


def test_every_cited_json_names_the_clean_commit_that_measured_it():
    """Every figure the pages cite comes from a JSON under benchmarks/ that records the commit of the code that
    ran it, with no uncommitted changes (``commit_dirty`` false); where a file name or the prose names a commit
    for a JSON, it is the one the JSON records."""
    cited, bad = _cited()
    assert len(cited) >= 10
    for page, name in cited:
        commit, dirty = _recorded(name)
        where = f"{page}: benchmarks/{name}"
        if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit)):
            bad.append(f"{where}: records no commit ({commit!r})")
            continue
        if dirty is not False:
            bad.append(f"{where}: recorded at {commit[:7]} with uncommitted changes (commit_dirty {dirty!r})")
        for named in NAMED.findall(name):
            if not commit.startswith(named):
                bad.append(f"{where}: its name says {named}, it records {commit[:7]}")
    for page in PAGES:
        for unit in _units(_read(page)):
            names = [os.path.basename(n) for n in dict.fromkeys(JSON_NAME.findall(unit))
                     if os.path.exists(os.path.join(ROOT, "benchmarks", os.path.basename(n)))]
            named = list(dict.fromkeys(COMMIT.findall(unit)))
            if not names or not named:
                continue
            commits = {n: _recorded(n)[0] or "" for n in names}
            said = " ".join(unit.split())[:160]
            for c in named:
                if not any(r.startswith(c) for r in commits.values()):
                    bad.append(f"{os.path.relpath(page, ROOT)}: names {c} beside {', '.join(names)}, which record "
                               f"{', '.join(r[:7] for r in commits.values())}: {said!r}")
            for n, r in commits.items():
                if not any(r.startswith(c) for c in named):
                    bad.append(f"{os.path.relpath(page, ROOT)}: {n} records {r[:7]}, the prose beside it names "
                               f"{', '.join(named)}: {said!r}")
    assert not bad, "\n".join(bad)


def test_the_commit_check_catches_a_dirty_an_unrecorded_and_a_misnamed_run(tmp_path, monkeypatch):
    """The check above fails on each kind of bad citation, planted in a copy of the pages."""
    import shutil

    here = tmp_path / "repo"
    for name in ("benchmarks", "docs"):
        shutil.copytree(os.path.join(ROOT, name), str(here / name))
    monkeypatch.setitem(globals(), "ROOT", str(here))
    monkeypatch.setitem(globals(), "PAGES", [str(here / "README.md")] + sorted(glob.glob(str(here / "docs" / "*.md"))))
    clean = "a" * 40

    def plant(record: dict, prose: str) -> str:
        with open(here / "benchmarks" / "planted-run.json", "w", encoding="utf-8") as f:
            json.dump({"machine": record}, f)
        (here / "README.md").write_text(_read(README) + "\n" + prose + "\n", encoding="utf-8")
        try:
            test_every_cited_json_names_the_clean_commit_that_measured_it()
        except AssertionError as e:
            return str(e)
        return ""

    assert plant({"commit": clean, "commit_dirty": False}, "One run (`benchmarks/planted-run.json`).") == ""
    assert "records no commit" in plant({"cpu": "x"}, "One run (`benchmarks/planted-run.json`).")
    assert "uncommitted changes" in plant({"commit": clean, "commit_dirty": True}, "Raw JSON: planted-run.json.")
    assert "names b1b2b3b beside planted-run.json" in plant(
        {"commit": clean, "commit_dirty": False}, "Measured at `b1b2b3b` (raw JSON: `benchmarks/planted-run.json`).")
    shutil.copy(here / "benchmarks" / "planted-run.json", here / "benchmarks" / "planted-run-b1b2b3b.json")
    assert "its name says b1b2b3b, it records aaaaaaa" in plant(
        {"commit": clean, "commit_dirty": False}, "One run (`benchmarks/planted-run-b1b2b3b.json`).")
    assert "no such file" in plant({"commit": clean, "commit_dirty": False}, "See `benchmarks/gone-run.json`.")
