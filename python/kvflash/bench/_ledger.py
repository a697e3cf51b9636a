"""A second needle haystack: procedural town records full of numbers.

The bench's first haystack (_prose.py) holds no digits, so a numeric needle is the only number in its
prompts.  Held-out figures need a text where it is not: this one reads like a clerk's ledger and
almanac (years, tallies, prices, distances, parcel and account numbers, gate and lock codes), so the
prompt is full of 3-6 digit numbers, some of them 5-digit codes introduced by words close to the
needle's ("the code", "the number").  It is generated here from templates, deterministic for a seed,
and is original text placed in the public domain (CC0).  Generated in memory on first use (no file).
"""
from __future__ import annotations

import functools
import random

TOWNS = ["Harwick", "Long Ashby", "Caldmoor", "Wexley Cross", "Saltreach", "Brindle", "Ottery Vale",
         "Kestwick", "Marrowby", "Fenholt", "Greywater", "Dunmere", "Lowestreach", "Ambleford", "Quarrington",
         "Tillbury Marsh", "Redhythe", "Colcastle", "Elmswade", "Northope"]
CLERKS = ["the town clerk", "the assessor", "the harbour office", "the parish register", "the tithe collector",
          "the quartermaster", "the customs house", "the mill's bookkeeper", "the surveyor's office",
          "the guild secretary"]
GOODS = ["bales of wool", "barrels of herring", "sacks of barley", "casks of cider", "loads of timber",
         "tons of slate", "bolts of linen", "crates of glassware", "bundles of reeds", "cartloads of lime",
         "hundredweight of salt", "dozen cheeses"]
PLACES = ["the north gate", "the granary", "the toll bridge", "the counting house", "the east warehouse",
          "the bonded store", "the chapel vault", "the ropewalk", "the lock keeper's hut", "the coal wharf",
          "the guildhall archive", "the lower quay"]
UNITS = ["miles", "furlongs", "yards", "leagues"]
EVENTS = ["a great storm", "the river flood", "an outbreak of fever", "the fire at the tannery",
          "a poor harvest", "the opening of the canal", "the new turnpike", "the census", "a dispute over grazing",
          "the rebuilding of the quay"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

SENTENCES = [
    "In {year} {clerk} of {town} recorded {n3} {goods} shipped before {month}, against {n3b} the year before.",
    "The distance from {town} to {town2} was measured in {year} as {n2} {unit}, though carters claimed it was longer.",
    "Parcel {n5} on the east side of {town} was sold in {year} for {n4} shillings to a family from {town2}.",
    "After {event} of {year}, the population of {town} fell from {n4} to {n4b}, and did not recover for a decade.",
    "The lock on {place} of {town} was changed in {year}; the new code, {n4}, was given only to the watchmen.",
    "Account {n5} at {town}'s counting house paid {n3} pounds in rents in {month} {year}.",
    "{clerk_cap} noted that {n3} households in {town} kept bees, and that {n2} of them sold honey at market.",
    "The toll at {place} rose in {year} to {n2} pence a cart, and {n4} carts passed in the first month.",
    "A survey of {year} counted {n4} acres of common land around {town}, of which {n3} lay under water in winter.",
    "The register number of the ferry at {town} was {n5}, painted in white on both sides of the bow.",
    "Between {year} and {year2} the price of {goods} at {town} rose from {n2} to {n3} pence.",
    "The bell of {town}'s church weighs {n4} pounds and was cast in {year}, the year of {event}.",
    "{clerk_cap} filed report {n5} on {event}, listing {n3} claims for damages and {n2} for lost stock.",
    "By {month} {year}, {n3} {goods} were stored at {place} of {town}, worth some {n4} pounds in all.",
    "The milestone outside {town} reads {n2} {unit} to {town2} and {n3} to the sea.",
    "In the winter of {year} the harbour of {town} froze for {n2} days, and {n3} vessels waited at anchor.",
    "The key ledger of {place} in {town} lists entry {n5} as the spare key, kept by {clerk}.",
    "Wages at the {town} mill were {n2} shillings a week in {year}, and {n3} hands were employed there.",
    "The well at {town} was dug to {n3} feet in {year}, after {event} had fouled the old one.",
    "A charter of {year} granted {town} a market every {day}, with stalls let at {n2} pence each.",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]


def _fill(rng: random.Random, tmpl: str, town: str) -> str:
    r = rng.randint
    year = r(1640, 1899)
    clerk = rng.choice(CLERKS)
    vals = dict(town=town, town2=rng.choice([t for t in TOWNS if t != town]), clerk=clerk,
                clerk_cap=clerk[0].upper() + clerk[1:], goods=rng.choice(GOODS), place=rng.choice(PLACES),
                unit=rng.choice(UNITS), event=rng.choice(EVENTS), month=rng.choice(MONTHS), day=rng.choice(DAYS),
                year=year, year2=year + r(3, 40), n2=r(11, 99), n3=r(100, 999), n3b=r(100, 999),
                n4=r(1000, 9999), n4b=r(1000, 9999), n5=r(10000, 99999))
    return tmpl.format(**vals)


def generate(n_chars: int = 320_000, seed: int = 4711) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        town = rng.choice(TOWNS)
        title = rng.choice(["Records of {T}", "An Almanac of {T}", "Accounts Kept at {T}", "Notes on {T}"]).format(T=town)
        section = [title, ""]
        for _ in range(rng.randint(3, 6)):
            section.append(" ".join(_fill(rng, rng.choice(SENTENCES), town) for _ in range(rng.randint(4, 8))))
            section.append("")
        text = "\n".join(section) + "\n"
        out.append(text)
        size += len(text)
    return "".join(out)


@functools.lru_cache(maxsize=1)
def ledger_text() -> str:
    return generate()


if __name__ == "__main__":
    import sys
    sys.stdout.write(generate())
