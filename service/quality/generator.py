"""Synthetic multi-document QA: invented people and organisations, so no model can answer from memory.

Each question comes with k chunks in a shuffled order:
- the gold chunk(s): one for a one-fact question, two for a two-fact question (the founder of an organisation is
  named in the organisation's chunk, the founder's birth year or place only in the founder's own chunk);
- a near-miss: an entity whose name differs by one letter, with different facts (tests that the model reads the
  name rather than matching its shape);
- distractors: other invented entities' chunks.

Names are built from syllables by a seeded `random.Random`, and every name is used once per file, so each answer
is unambiguous. The output is a pure function of the arguments: same seed, same bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "kr", "st", "dr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "x", "rk", "nd")
_PLACE_ENDINGS = ("ia", "mar", "holm", "vale", "grad", "ora", "stead")
_ORG_KINDS = ("Institute", "Company", "Guild", "Foundry", "Observatory", "Society", "Press")
_PROFESSIONS = ("cartographer", "glassblower", "astronomer", "engineer", "composer", "botanist", "clockmaker")
_YEARS = (1701, 1989)
_ATTEMPTS = 10_000


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


@dataclass(frozen=True)
class Person:
    name: str
    birthplace: str
    birth_year: int
    profession: str

    def chunk(self) -> str:
        return (
            f"{self.name} was born in {self.birthplace} in {self.birth_year}. "
            f"{self.name.split()[0]} worked as {_article(self.profession)} {self.profession} for most of a long life."
        )


@dataclass(frozen=True)
class Organisation:
    name: str
    founder: Person
    founded: int
    city: str

    def chunk(self) -> str:
        return (
            f"The {self.name} was founded by {self.founder.name} in {self.founded}. "
            f"Its main building stands in {self.city}."
        )


@dataclass(frozen=True)
class Question:
    text: str
    answers: tuple[str, ...]
    gold: tuple[str, ...]  # the chunks that together hold the answer
    near_miss: str  # a chunk about a one-letter-different entity
    hops: int


class World:
    """Invents entities whose names never repeat within one generator run."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._used: set[str] = set()

    def _word(self, syllables: int) -> str:
        parts = [
            self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS) for _ in range(syllables)
        ]
        return "".join(parts).capitalize()

    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(_ATTEMPTS):
            name = make()
            if name not in self._used:
                self._used.add(name)
                return name
        raise RuntimeError(f"no unused name after {_ATTEMPTS} attempts; the syllable tables are too small")

    def place(self) -> str:
        return self._unique(lambda: self._word(self.rng.randint(1, 2)) + self.rng.choice(_PLACE_ENDINGS))

    def person_name(self) -> str:
        return self._unique(lambda: f"{self._word(2)} {self._word(self.rng.randint(1, 2))}")

    def near_name(self, name: str, word: int = -1) -> str:
        """The same name with one letter (not the first) of one word changed: a plausible look-alike."""

        def mutate() -> str:
            words = name.split(" ")
            target = words[word]
            index = self.rng.randrange(1, len(target))
            letter = self.rng.choice([c for c in "aeiourlnst" if c != target[index]])
            words[word] = target[:index] + letter + target[index + 1 :]
            return " ".join(words)

        return self._unique(mutate)

    def person(self, name: str | None = None) -> Person:
        year = self.rng.randint(*_YEARS)
        return Person(name or self.person_name(), self.place(), year, self.rng.choice(_PROFESSIONS))

    def organisation(self, name: str | None = None) -> Organisation:
        founder = self.person()
        org = name or self._unique(lambda: f"{self._word(2)} {self.rng.choice(_ORG_KINDS)}")
        founded = min(founder.birth_year + self.rng.randint(20, 60), _YEARS[1] + 30)
        return Organisation(org, founder, founded, self.place())

    def near_organisation(self, org: Organisation) -> Organisation:
        """Its kind kept, its first word one letter off, other founder and facts."""
        return self.organisation(self.near_name(org.name, word=0))


def one_fact_question(world: World) -> Question:
    """A question whose answer is one fact in one chunk."""
    rng = world.rng
    if rng.random() < 0.5:
        person = world.person()
        twin = world.person(world.near_name(person.name))
        text, answer = rng.choice(
            [
                (f"In which year was {person.name} born?", str(person.birth_year)),
                (f"Where was {person.name} born?", person.birthplace),
            ]
        )
        return Question(text, (answer,), (person.chunk(),), twin.chunk(), 1)
    org = world.organisation()
    twin_org = world.near_organisation(org)
    text, answer = rng.choice(
        [
            (f"Who founded the {org.name}?", org.founder.name),
            (f"In which year was the {org.name} founded?", str(org.founded)),
            (f"In which city does the {org.name} have its main building?", org.city),
        ]
    )
    return Question(text, (answer,), (org.chunk(),), twin_org.chunk(), 1)


def two_fact_question(world: World) -> Question:
    """A question that needs the organisation's chunk (who founded it) and the founder's chunk (the fact)."""
    org = world.organisation()
    founder = org.founder
    twin = world.person(world.near_name(founder.name))  # the founder's look-alike, with other facts
    text, answer = world.rng.choice(
        [
            (f"In which year was the founder of the {org.name} born?", str(founder.birth_year)),
            (f"Where was the founder of the {org.name} born?", founder.birthplace),
        ]
    )
    return Question(text, (answer,), (org.chunk(), founder.chunk()), twin.chunk(), 2)


def distractor(world: World) -> str:
    return world.person().chunk() if world.rng.random() < 0.5 else world.organisation().chunk()


def record(world: World, question: Question, chunks: int, number: int) -> dict[str, object]:
    """One JSONL record: gold chunks, the near-miss and distractors up to `chunks`, shuffled."""
    context = [*question.gold]
    if len(context) < chunks:
        context.append(question.near_miss)
    while len(context) < chunks:
        context.append(distractor(world))
    world.rng.shuffle(context)
    return {
        "id": f"q{number:06d}",
        "question": question.text,
        "chunks": context,
        "answers": list(question.answers),
        "hops": question.hops,
    }


def minimum_chunks(two_fact_share: float) -> int:
    """A two-fact question needs both of its gold chunks in the context."""
    return 2 if two_fact_share > 0 else 1


def generate_records(
    questions: int, chunks: int, seed: int, two_fact_share: float = 0.3
) -> Iterator[dict[str, object]]:
    """`questions` records of `chunks` chunks; round(share × questions) of them, at seeded places, need two facts."""
    if questions < 1:
        raise ValueError("--questions must be at least 1")
    if not 0.0 <= two_fact_share <= 1.0:
        raise ValueError("--two-fact-share must be within 0..1")
    if chunks < minimum_chunks(two_fact_share):
        raise ValueError(f"--chunks must be at least {minimum_chunks(two_fact_share)} (two-fact questions need two)")
    rng = random.Random(seed)
    two_fact = set(rng.sample(range(questions), round(two_fact_share * questions)))
    world = World(rng)
    for number in range(questions):
        question = two_fact_question(world) if number in two_fact else one_fact_question(world)
        yield record(world, question, chunks, number)


def write_qa_file(path: str | Path, questions: int, chunks: int, seed: int, two_fact_share: float = 0.3) -> Path:
    """Write the records as UTF-8 JSONL (fixed key order, one record per line) and return the path."""
    out = Path(path)
    lines = [
        json.dumps(r, ensure_ascii=False) + "\n" for r in generate_records(questions, chunks, seed, two_fact_share)
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines), encoding="utf-8")
    return out
