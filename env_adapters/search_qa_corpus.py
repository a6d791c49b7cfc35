"""A generated multi-hop QA corpus for ``search_qa``: fictional people, companies, cities and countries.

Every entity has one passage, and a passage names only the entities one relation away (a person's employer and
birth city, a company's headquarters city, a city's country). A question chains 2 or 3 relations from a person
("In which country is the company that Velmora Tansk works for headquartered?"), so answering needs one search per
hop. The names are made of random syllables, so no pretrained model knows them. Deterministic in ``seed``.

    passages, questions = generate_corpus(seed=0)
    write_corpus("data/multihop", seed=0)       # passages.jsonl + questions.jsonl, search_qa's file format
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["generate_corpus", "write_corpus"]

_ONSETS = ("b", "br", "d", "dr", "f", "g", "k", "kl", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "th", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io", "ou")
_CODAS = ("", "n", "r", "l", "s", "x", "th", "nd", "rk")
_JOBS = ("chemist", "engineer", "painter", "pilot", "teacher", "surgeon", "architect", "baker", "sailor", "judge")
_TRADES = ("shipbuilding", "software", "textiles", "mining", "publishing", "robotics", "shipping", "optics")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _names(rng: random.Random, n: int, make) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        name = make()
        if name.lower() not in seen:
            seen.add(name.lower())
            out.append(name)
    return out


def generate_corpus(seed: int = 0, n_people: int = 40, n_companies: int = 12, n_cities: int = 8,
                    n_countries: int = 4) -> tuple[list[dict], list[dict]]:
    """``(passages, questions)``: passages ``{"id", "title", "text"}``, questions ``{"id", "question", "answers",
    "hops", "support"}`` (``support``: the passage ids of the chain, in hop order)."""
    if min(n_people, n_companies, n_cities, n_countries) < 1:
        raise ValueError("generate_corpus: every entity count must be >= 1")
    rng = random.Random(seed)
    countries = _names(rng, n_countries, lambda: _word(rng, 2).capitalize() + rng.choice(("ia", "land", "stan")))
    cities = _names(rng, n_cities, lambda: _word(rng, 2).capitalize() + rng.choice(("port", "ford", "holm", "")))
    companies = _names(rng, n_companies, lambda: f"{_word(rng, 2).capitalize()} "
                                                 f"{rng.choice(('Labs', 'Works', 'Industries', 'Group'))}")
    people = _names(rng, n_people, lambda: f"{_word(rng, 2).capitalize()} {_word(rng, 2).capitalize()}")
    city_country = {c: rng.choice(countries) for c in cities}
    company_city = {c: rng.choice(cities) for c in companies}
    person = {}
    for p in people:  # born elsewhere than the employer's headquarters: no 2-hop answer sits in the first passage
        company = rng.choice(companies)
        others = [c for c in cities if c != company_city[company]] or cities
        person[p] = (company, rng.choice(others), rng.choice(_JOBS))

    passages: list[dict] = []
    pid: dict[str, str] = {}

    def add(title: str, text: str) -> None:
        pid[title] = f"p{len(passages)}"
        passages.append({"id": pid[title], "title": title, "text": text})

    for c in countries:
        add(c, f"{c} is a country. Its people are known for {rng.choice(_TRADES)} and long winters.")
    for c in cities:
        add(c, f"{c} is a city in the country of {city_country[c]}. It lies on a river and has an old harbour.")
    for c in companies:
        trade = rng.choice(_TRADES)
        add(c, f"{c} is {'an' if trade[0] in 'aeiou' else 'a'} {trade} company headquartered in the city of {company_city[c]}.")
    for p, (company, city, job) in person.items():
        add(p, f"{p} is {'an' if job[0] in 'aeiou' else 'a'} {job} who works for {company}. {p} was born in the city of {city}.")

    questions: list[dict] = []
    for p, (company, city, _) in person.items():
        hq = company_city[company]
        chains = [
            (f"In which city is the company that {p} works for headquartered?", hq, [p, company]),
            (f"In which country was {p} born?", city_country[city], [p, city]),
            (f"In which country is the company that {p} works for headquartered?", city_country[hq],
             [p, company, hq]),
        ]
        for text, answer, support in chains:
            questions.append({"id": f"q{len(questions)}", "question": text, "answers": [answer],
                              "hops": len(support), "support": [pid[s] for s in support]})
    return passages, questions


def write_corpus(folder: str | os.PathLike, seed: int = 0, **sizes) -> tuple[Path, Path]:
    """Write ``passages.jsonl`` and ``questions.jsonl`` of :func:`generate_corpus` into ``folder``; their paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    passages, questions = generate_corpus(seed, **sizes)
    paths = out / "passages.jsonl", out / "questions.jsonl"
    for path, rows in zip(paths, (passages, questions)):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return paths
