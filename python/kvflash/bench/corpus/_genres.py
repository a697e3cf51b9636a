"""The genres' generators: each turns an RNG and one split's Vocab into an endless stream of Units.

Every template and word list below is cut in two by position (`_base.half`): a tuning document is built
from the even entries only, a reporting document from the odd ones.  Written for kvflash; the text is
original and placed in the public domain (CC0).
"""
from __future__ import annotations

import random
from typing import Iterator

from ._base import MONTHS, WEEKDAYS, Unit, Vocab, cap, hhmm, hms

# ----------------------------------------------------------------------------- code (Python-like modules)
CODE = dict(
    nouns=["invoice", "sensor", "ticket", "parcel", "shipment", "badge", "route", "session", "payload", "reading",
           "batch", "voucher", "segment", "meter", "tariff", "slot", "bucket", "frame", "quota", "lease",
           "manifest", "probe", "sample", "cursor", "handle", "window", "channel", "ledger", "pallet", "beacon",
           "station", "recipe", "crate", "coupon", "tenant", "sprocket", "kiosk", "turbine", "locker", "gauge"],
    verbs=["load", "parse", "merge", "render", "flush", "resolve", "validate", "encode", "split", "rank",
           "collect", "prune", "retry", "schedule", "summarize", "normalize", "attach", "archive", "expand",
           "refresh", "reconcile", "throttle", "compact", "inspect"],
    imports=["import os", "import re", "import json", "import sys", "import time", "import math", "import hashlib",
             "import logging", "from pathlib import Path", "from typing import Optional",
             "from dataclasses import dataclass", "from collections import Counter", "import itertools",
             "import functools", "import random", "import struct", "import heapq", "import bisect",
             "import zlib", "import csv"],
    comments=["# {verb} every {noun} before the {noun2} is written back",
              "# a {noun} without a {noun2} is skipped, not an error",
              "# keep this cheap: it runs once per {noun}",
              "# the {noun2} list is sorted by id here, so bisect works",
              "# historical quirk: old {noun} records used seconds, not milliseconds",
              "# see the {noun2} module for the matching writer",
              "# guard against an empty {noun} batch from the upstream feed",
              "# callers rely on the order of {noun2} entries staying stable",
              "# TODO: fold this into {verb}_{noun2} once the migration lands",
              "# FIXME: slow for large {noun} tables; index by {noun2} id",
              "# the retry budget is shared with {verb}_{noun2}",
              "# rounding happens last so the {noun} totals still add up"],
    bodies=[
        ["def {verb}_{noun}({noun}, {noun2}=None):",
         "    \"\"\"{Verb} one {noun}, optionally against a {noun2}.\"\"\"",
         "    if {noun} is None:",
         "        return None",
         "    result = dict({noun})",
         "    if {noun2} is not None:",
         "        result[\"{noun2}\"] = {noun2}",
         "    return result"],
        ["class {Noun}Store:",
         "    def __init__(self, path):",
         "        self.path = path",
         "        self.items = []",
         "",
         "    def add(self, {noun}):",
         "        self.items.append({noun})",
         "        return len(self.items)"],
        ["def {verb}_all({noun}s, limit={k}):",
         "    out = []",
         "    for {noun} in {noun}s[:limit]:",
         "        {comment}",
         "        out.append({verb}_{noun}({noun}))",
         "    return out"],
        ["def count_{noun}s(rows):",
         "    totals = {{}}",
         "    for row in rows:",
         "        key = row.get(\"{noun2}\", \"unknown\")",
         "        totals[key] = totals.get(key, 0) + 1",
         "    return totals"],
        ["async def fetch_{noun}(client, {noun2}_id):",
         "    {comment}",
         "    response = await client.get(f\"/{noun}s/{{{noun2}_id}}\")",
         "    response.raise_for_status()",
         "    return response.json()"],
        ["def _{noun}_key({noun}):",
         "    return ({noun}.{noun2}, {noun}.created, {noun}.id)"],
        ["@dataclass",
         "class {Noun}:",
         "    id: int",
         "    {noun2}: str",
         "    weight: float = {f}",
         "    tags: list = None"],
        ["def {verb}_{noun}_batch(batch, retries={k}):",
         "    attempt = 0",
         "    while attempt < retries:",
         "        try:",
         "            return {verb}_{noun2}(batch)",
         "        except TimeoutError:",
         "            attempt += 1",
         "            time.sleep({f} * attempt)",
         "    raise RuntimeError(\"gave up on {noun} batch\")"],
        ["def is_valid_{noun}({noun}):",
         "    {comment}",
         "    if not {noun}.get(\"id\"):",
         "        return False",
         "    return {noun}.get(\"{noun2}\", 0) >= {k}"],
        ["class {Noun}Error(Exception):",
         "    \"\"\"Raised when a {noun} cannot be {verb}d.\"\"\"",
         "",
         "    def __init__(self, {noun2}, reason):",
         "        super().__init__(reason)",
         "        self.{noun2} = {noun2}"],
        ["def {verb}_window(values, size={k}):",
         "    acc = sum(values[:size])",
         "    best = acc",
         "    for i in range(size, len(values)):",
         "        acc += values[i] - values[i - size]",
         "        best = max(best, acc)",
         "    return best"],
        ["def write_{noun}s(path, {noun}s):",
         "    {comment}",
         "    with open(path, \"w\") as fh:",
         "        for {noun} in {noun}s:",
         "            fh.write(json.dumps({noun}) + \"\\n\")",
         "    return path"],
    ],
)


def code_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    def line(text: str) -> Unit:
        return Unit(text + "\n", {"indent": text[:len(text) - len(text.lstrip())]})
    noun = v.pick(rng, "nouns")
    yield line(f"\"\"\"Helpers for {noun} records: reading, checking and writing them.\"\"\"")
    for imp in sorted(rng.sample(v["imports"], 4)):
        yield line(imp)
    while True:
        yield Unit("\n", {"indent": ""})
        yield Unit("\n", {"indent": ""})
        n1, n2 = rng.sample(v["nouns"], 2)
        verb, verb2 = rng.choice(v["verbs"]), rng.choice(v["verbs"])
        f = dict(noun=n1, noun2=n2, Noun="".join(cap(p) for p in n1.split("_")), verb=verb, Verb=cap(verb),
                 k=rng.randint(2, 64), f=round(rng.uniform(0.1, 4.0), 2))
        f["comment"] = rng.choice(v["comments"]).format(noun=n1, noun2=n2, verb=verb2)
        if rng.random() < 0.4:
            yield line(rng.choice(v["comments"]).format(noun=n2, noun2=n1, verb=verb2))
        for text in rng.choice(v["bodies"]):
            yield line(text.format(**f)) if text else Unit("\n", {"indent": "    "})


# ----------------------------------------------------------------------------- chat (multi-speaker IM)
CHAT = dict(
    nicks=["dana", "priya_k", "tomasz", "lwen", "okafor", "mbeki", "jules", "ravi_s", "hana", "ferdi", "ines",
           "kgomotso", "yusuf", "aiko", "bjorn", "camila", "deshawn", "elif", "gorka", "haruto", "ilse", "joao",
           "kiri", "lotte", "marek", "nadia", "osei", "pilar"],
    channels=["#ops", "#frontend", "#release", "#warehouse", "#support", "#data-eng", "#mobile", "#infra"],
    things=["the build", "staging", "the dashboard", "the invoice export", "the nightly job", "the mobile app",
            "the search index", "the printer on floor two", "the vpn", "the coffee machine", "the login page",
            "the migration", "the alert thresholds", "the release notes", "the warehouse scanner", "the cdn"],
    msgs=["anyone else seeing {thing} time out?", "yep, since about lunch", "restarting {thing} now",
          "ok that fixed it for me", "can someone review my PR for {thing}?", "on it",
          "{thing} is green again", "ugh, flaky test again", "lol", "brb, meeting",
          "did we ever decide who owns {thing}?", "I think {nick} does", "nope, that moved to platform",
          "heads up: deploying {thing} in five minutes", "thanks!", "rolling back {thing}, looks bad",
          "who broke {thing} :(", "not me this time", "is {thing} on the agenda tomorrow?", "+1",
          "should be fixed by end of day", "logs attached in the ticket", "{nick} can you take a look?",
          "sure, after standup", "can't reproduce {thing} locally", "works on my machine, famous last words",
          "ping me if {thing} acts up again", "sounds good", "lunch?", "five minutes",
          "we need a runbook for {thing}", "agreed, I'll draft one"],
    joins=["*** {nick} has joined {chan}", "*** {nick} has left {chan}", "*** {nick} is now away",
           "*** {nick} changed the topic to: {thing} this week"],
)


def chat_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    people = rng.sample(v["nicks"], 5)
    chan = rng.choice(v["channels"])
    t = rng.randint(7 * 60, 11 * 60)
    yield Unit(f"--- log of {chan}, {rng.choice(WEEKDAYS)} {rng.randint(1, 28)} {rng.choice(MONTHS)} ---\n",
               {"time": hhmm(t), "nick": people[0], "nick2": people[1]})
    while True:
        a, b = rng.sample(people, 2)
        at = {"time": hhmm(t), "nick": a, "nick2": b}
        if rng.random() < 0.06:
            text = rng.choice(v["joins"]).format(nick=rng.choice(people), chan=chan, thing=rng.choice(v["things"]))
        else:
            msg = rng.choice(v["msgs"]).format(thing=rng.choice(v["things"]), nick=b)
            text = f"[{hhmm(t)}] {a}: {msg}"
        yield Unit(text + "\n", at)
        t += rng.choice([0, 0, 1, 1, 2, 3, 7])


# ----------------------------------------------------------------------------- csv (tables)
# a schema: table name, then (column, kind) pairs; kinds: date, id:PREFIX, word:LIST, int:LO:HI, money:LO:HI
CSV = dict(
    schemas=[
        ("shipments", [("date", "date"), ("shipment_id", "id:SH"), ("carrier", "word:carriers"),
                       ("crates", "int:1:90"), ("weight_kg", "money:20:4000")]),
        ("inventory", [("sku", "id:SKU"), ("item", "word:items"), ("bin", "word:bins"), ("on_hand", "int:0:900"),
                       ("unit_cost", "money:1:250")]),
        ("payroll", [("employee", "word:people"), ("team", "word:teams"), ("hours", "int:10:60"),
                     ("rate", "money:15:90"), ("period_end", "date")]),
        ("readings", [("station", "word:stations"), ("timestamp", "date"), ("temp_c", "money:-20:40"),
                      ("humidity", "int:5:100"), ("wind_kmh", "int:0:120")]),
        ("orders", [("order_no", "id:ORD"), ("customer", "word:people"), ("item", "word:items"),
                    ("qty", "int:1:40"), ("total", "money:5:3000"), ("placed", "date")]),
        ("tickets", [("ticket", "id:TK"), ("opened", "date"), ("team", "word:teams"), ("priority", "int:1:5"),
                     ("status", "word:statuses")]),
        ("rentals", [("unit", "id:U"), ("tenant", "word:people"), ("start", "date"), ("months", "int:1:36"),
                     ("rent", "money:300:4000")]),
        ("trips", [("trip", "id:TR"), ("driver", "word:people"), ("station", "word:stations"),
                   ("km", "money:1:900"), ("stops", "int:1:30")]),
    ],
    carriers=["NorthLine", "Bluefin Freight", "Castor Haulage", "Delmar Express", "Evenstar Cargo", "Fjordway",
              "Granite Logistics", "Harrow & Sons", "Ironbridge", "Juniper Transport"],
    items=["hex bolt", "wall bracket", "copper pipe", "ceramic tile", "door hinge", "fuse box", "garden hose",
           "ladder", "paint roller", "rivet gun", "sandpaper", "tape measure", "work gloves", "wood glue",
           "cable tie", "drill bit", "socket set", "spirit level", "pliers", "extension cord"],
    bins=["A-01", "A-07", "B-03", "B-12", "C-02", "C-09", "D-04", "D-11", "E-05", "E-08"],
    people=["Abena Osei", "Bruno Keller", "Chen Jia", "Dorota Nowak", "Emeka Obi", "Freya Lund", "Goran Ilic",
            "Hiba Saleh", "Ivo Marin", "Jana Dvorak", "Kemal Aydin", "Lucia Ferro", "Mateus Silva", "Nora Haug",
            "Oren Levi", "Paula Ruiz", "Quentin Roy", "Rhea Kapoor", "Sami Virtanen", "Tuva Berg"],
    teams=["billing", "logistics", "platform", "support", "research", "facilities", "sales", "security"],
    stations=["Kestrel Ridge", "Lowmarsh", "Pike Point", "Saddleback", "Thornbury Gap", "Upper Fennick",
              "Westerholm", "Yarrow Flats", "Birchmoor", "Coldharbour"],
    statuses=["open", "closed", "waiting", "escalated", "triaged", "reopened", "resolved", "blocked"],
    notes=["", "", "", "checked", "late", "recount", "damaged box", "priority", "backorder", "partial",
           "verified", "returned", "on hold", "signed", "urgent", "estimate"],
)


def _cell(rng: random.Random, v: Vocab, kind: str, year: int) -> str:
    k, *a = kind.split(":")
    if k == "date":
        return f"{year}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if k == "id":
        return f"{a[0]}-{rng.randint(1000, 99999)}"
    if k == "word":
        w = rng.choice(v[a[0]])
        return f"\"{w}\"" if " " in w or "&" in w else w
    if k == "int":
        return str(rng.randint(int(a[0]), int(a[1])))
    return f"{rng.uniform(float(a[0]), float(a[1])):.2f}"


def csv_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    year = rng.randint(2015, 2030)
    prev = None
    while True:
        name, cols = rng.choice(v["schemas"])

        def prefix(c=cols) -> str:
            return ",".join(_cell(rng, v, kind, year) for _, kind in c) + ","
        before = prev or prefix   # a needle before a table's title ends the table above it
        yield Unit(f"\n# {name}.csv\n" + ",".join(c for c, _ in cols) + ",note\n", {"row": before()})
        for _ in range(rng.randint(15, 60)):
            note = rng.choice(v["notes"])
            yield Unit(prefix() + (f"\"{note}\"" if note else "") + "\n", {"row": prefix()})
        prev = prefix


# ----------------------------------------------------------------------------- wiki (encyclopedic prose)
WIKI = dict(
    subjects=["Valmora", "the Essing River", "Corvath Abbey", "the Tallin Plateau", "Brask", "the Ormun Canal",
              "Lake Seren", "Haddow Fell", "the Quell Observatory", "Pennick Island", "the Marrach Range",
              "Duvel", "the Isk Valley", "Castle Ardrum", "Tremont Sound", "the Kell Bridge"],
    kinds=["a market town", "a river", "a former monastery", "an upland plateau", "a port city",
           "a navigable canal", "a glacial lake", "a mountain", "an astronomical observatory", "an island",
           "a mountain range", "a fishing town", "a river valley", "a ruined castle", "a sea inlet", "a stone bridge"],
    regions=["the northern province", "the coastal lowlands", "the eastern marches", "the central basin",
             "the western isles", "the southern uplands", "the lake district", "the river plain"],
    peoples=["Ardish settlers", "the Vell", "merchant guilds", "a religious order", "the crown surveyors",
             "fur traders", "the river clans", "engineers from the capital"],
    industries=["slate quarrying", "salmon fishing", "wool trading", "glassmaking", "shipbuilding",
                "peat cutting", "silver mining", "tourism", "forestry", "brewing"],
    sentences=[
        "{S} is {kind} in {region}, known for its {industry}.",
        "The earliest written record of {s} dates from {year}, in a charter granted to {people}.",
        "According to the census of {year}, {s} had a population of {n}.",
        "During the {century} century {s} grew rapidly as {industry} expanded.",
        "The name is thought to derive from an older word for a crossing or ford.",
        "{S} lies at an elevation of about {m} metres above sea level.",
        "The climate is temperate, with mild summers and wet, windy winters.",
        "A railway line reached {s} in {year}, ending its long isolation.",
        "Much of the surrounding land is protected as a nature reserve.",
        "Historians disagree about the role of {people} in its founding.",
        "{S} was badly damaged by a flood in {year} and rebuilt over the following decade.",
        "Its annual fair, held each autumn, draws visitors from across {region}.",
        "The local economy today depends mostly on {industry} and services.",
        "A small museum documents the history of {industry} in the area.",
        "The main road through {s} follows the line of an ancient track.",
        "Several buildings in the old quarter are listed as monuments.",
        "In {year} a survey measured the main channel at {m} metres wide.",
        "{S} is twinned with a town of similar size across the strait.",
        "The surrounding hills are crossed by a network of walking trails.",
        "Records from {year} describe a dispute between {people} and the local council.",
    ],
    headings=["History", "Geography", "Economy", "Climate", "Culture", "Transport", "Demographics", "Landmarks",
              "Etymology", "Notable events"],
)


def wiki_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    while True:
        i = rng.randrange(len(v["subjects"]))
        s = v["subjects"][i]
        kind = v["kinds"][i % len(v["kinds"])]
        yield Unit(f"{cap(s.replace('the ', ''))}\n\n", {})
        for h in rng.sample(v["headings"], rng.randint(3, 5)):
            yield Unit(f"== {h} ==\n\n", {})
            for p in range(rng.randint(1, 3)):
                n = rng.randint(3, 7)
                for j in range(n):
                    f = dict(s=s, S=cap(s), kind=kind, region=v.pick(rng, "regions"), people=v.pick(rng, "peoples"),
                             industry=v.pick(rng, "industries"), year=rng.randint(1120, 1995),
                             century=rng.choice(["twelfth", "fourteenth", "sixteenth", "eighteenth", "nineteenth"]),
                             n=f"{rng.randint(300, 90000):,}", m=rng.randint(4, 2400))
                    end = "\n\n" if j == n - 1 else " "
                    yield Unit(rng.choice(v["sentences"]).format(**f) + end, {})


# ----------------------------------------------------------------------------- manual (instructions, recipes)
MANUAL = dict(
    devices=["the dehumidifier", "the bread maker", "the label printer", "the pressure washer", "the router",
             "the espresso machine", "the sewing machine", "the robot vacuum", "the water heater", "the drone"],
    parts=["the filter", "the lid", "the power cable", "the water tank", "the front panel", "the brush roll",
           "the drip tray", "the reset button", "the battery", "the nozzle", "the paper guide", "the dial"],
    dishes=["lentil soup", "flatbread", "apple crumble", "vegetable curry", "rye loaf", "fish stew",
            "tomato sauce", "oat biscuits", "mushroom risotto", "plum jam"],
    ingredients=["onion", "garlic clove", "carrot", "plain flour", "butter", "brown sugar", "rolled oats",
                 "tinned tomatoes", "red lentils", "olive oil", "stock", "lemon", "fresh ginger", "cumin",
                 "dried yeast", "apples", "cream", "parsley", "rice", "white fish"],
    units=[("g", 50, 500), ("ml", 50, 750), ("tbsp", 1, 4), ("tsp", 1, 3), ("cups", 1, 3), ("pieces", 1, 6)],
    steps=["Switch off {device} and unplug {part}.", "Remove {part} by pulling it gently towards you.",
           "Rinse {part} under lukewarm water and let it dry completely.", "Check that {part} clicks into place.",
           "Hold the power button for {n} seconds until the light blinks.", "Wait {n} minutes before restarting.",
           "Wipe {part} with a soft, dry cloth.", "Do not use solvents on {part}.",
           "Refit {part} and close the cover.", "If the warning light stays on, repeat steps 2 to 4.",
           "Turn the dial to position {n} and press start.", "Empty {part} after every use.",
           "Tighten the two screws on {part} by hand.", "Store {device} upright in a dry place.",
           "Press and release the reset button once.", "Replace {part} every {n} months."],
    cook=["Heat the {ing} in a large pan over a medium flame.", "Chop the {ing} finely and add it to the pan.",
          "Stir for {n} minutes until soft but not brown.", "Add the {ing} and bring to a gentle simmer.",
          "Season to taste and set aside to cool.", "Preheat the oven to {t} degrees.",
          "Knead the dough for {n} minutes, then cover it.", "Bake for {n} minutes until golden.",
          "Blend until smooth, adding water if needed.", "Serve warm with a squeeze of {ing}.",
          "Leave to rest for {n} minutes before slicing.", "Fold in the {ing} with a metal spoon."],
    asides=["Tip: a little patience here saves time later.", "Note: the first run may be noisy.",
            "Caution: the surface stays hot for a while.", "Tip: this keeps for three days in the fridge.",
            "Note: times vary with the size of the batch.", "Caution: keep children away from the blade."],
)


def manual_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    while True:
        if rng.random() < 0.5:
            dev = v.pick(rng, "devices")
            yield Unit(f"\n## Cleaning and care of {dev}\n\n", {})
            for k in range(1, rng.randint(6, 12)):
                s = rng.choice(v["steps"]).format(device=dev, part=v.pick(rng, "parts"), n=rng.randint(2, 30))
                yield Unit(f"{k}. {s}\n", {})
                if rng.random() < 0.15:
                    yield Unit(v.pick(rng, "asides") + "\n", {})
        else:
            dish = v.pick(rng, "dishes")
            yield Unit(f"\n## {cap(dish)} (serves {rng.randint(2, 8)})\n\n", {})
            for ing in rng.sample(v["ingredients"], rng.randint(3, 6)):
                u, lo, hi = rng.choice(v["units"])
                yield Unit(f"- {rng.randint(lo, hi)} {u} {ing}\n", {})
            yield Unit("\n", {})
            for k in range(1, rng.randint(5, 10)):
                s = rng.choice(v["cook"]).format(ing=v.pick(rng, "ingredients"), n=rng.randint(2, 45),
                                                 t=rng.choice([160, 180, 200, 220]))
                yield Unit(f"{k}. {s}\n", {})
                if rng.random() < 0.1:
                    yield Unit(v.pick(rng, "asides") + "\n", {})


# ----------------------------------------------------------------------------- fiction (narrative, dialogue)
FICTION = dict(
    names=["Mirela", "Anselm", "Tamsin", "Oduya", "Casimir", "Wren", "Ilario", "Sunniva", "Dashiell", "Yevgenia",
           "Perpetua", "Ludo", "Aurelie", "Konstantin", "Nessa", "Teodor", "Isaura", "Fitz", "Honora", "Radek"],
    places=["the station platform", "the back of the bakery", "the ferry's lower deck", "the attic",
            "the greenhouse", "the empty classroom", "the hotel corridor", "the bus shelter", "the chapel steps",
            "the boatyard"],
    narration=["{A} waited on {place} until the light began to fail.",
               "The wind pulled at {a}'s coat, and somewhere below a door banged twice.",
               "Neither of them spoke for a while; the kettle ticked as it cooled.",
               "{A} counted the windows across the street, the way {a} had as a child.",
               "It had rained all afternoon, and {place} smelled of wet stone and diesel.",
               "{B} turned the ring on one finger, round and round, without noticing.",
               "Down the hill a dog barked, and then, as if embarrassed, stopped.",
               "{A} remembered the letter folded in a pocket and decided not to mention it.",
               "The clock over {place} had been wrong for years, and everyone set their watches by it anyway.",
               "By the time {b} came back, the tea had gone cold and the cards were put away.",
               "There was a photograph on the wall that nobody ever explained.",
               "{B} laughed, but it was the careful laugh of someone keeping a secret."],
    lines=["\"You're late,\" {a} said.", "\"I know. The roads were flooded past the mill,\" said {b}.",
           "\"Did anyone see you?\" {a} asked quietly.", "\"Only the old man with the bicycle.\"",
           "\"Then we have until morning,\" said {a}.", "\"That's not long enough,\" {b} said, \"not for this.\"",
           "\"Sit down. You look frozen.\"", "\"Where did you put the key?\" {b} asked.",
           "\"Somewhere safe. Safer than your pocket,\" {a} said.", "\"Tell me again what she said.\"",
           "\"She said to wait, and not to trust the driver.\"", "\"And you believed her?\" asked {b}.",
           "\"I believed the look on her face,\" said {a}.", "\"We should have left yesterday.\"",
           "\"We should have done a lot of things,\" {b} said."],
)


def fiction_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    chapter = 1
    while True:
        a, b = rng.sample(v["names"], 2)
        place = v.pick(rng, "places")
        yield Unit(f"Chapter {chapter}\n\n", {"a": a, "b": b})
        chapter += 1
        for _ in range(rng.randint(8, 20)):
            f = dict(a=a, b=b, A=a, B=b, place=place)
            if rng.random() < 0.5:
                text = " ".join(rng.choice(v["narration"]).format(**f) for _ in range(rng.randint(1, 3)))
            else:
                text = rng.choice(v["lines"]).format(**f)
            yield Unit(text + "\n\n", {"a": a, "b": b})


# ----------------------------------------------------------------------------- syslog (system and access logs)
SYSLOG = dict(
    hosts=["web-01", "web-02", "db-main", "db-replica", "cache-a", "cache-b", "batch-07", "edge-fra",
           "edge-sin", "auth-1", "mq-03", "build-2"],
    users=["deploy", "backup", "alice", "root", "jenkins", "monitor", "svc-etl", "bob"],
    paths=["/api/v1/orders", "/api/v2/users", "/static/app.js", "/healthz", "/login", "/api/v1/search",
           "/favicon.ico", "/metrics", "/api/v2/invoices", "/img/logo.png", "/api/v1/cart", "/docs/index.html"],
    agents=["curl/8.5.0", "Go-http-client/1.1", "python-requests/2.32", "kube-probe/1.29", "Wget/1.21.4",
            "Mozilla/5.0 (X11; Linux x86_64)"],
    zones=["+0000", "+0200", "+0100", "-0500", "+0530", "-0800"],
    nets=["10.4", "172.16", "10.21", "192.168", "10.9", "172.20"],
    # daemon|message
    msgs=["sshd|Accepted publickey for {user} from {ip} port {port} ssh2",
          "cron|({user}) CMD (run-parts /etc/cron.hourly)",
          "nginx|connection reset by peer while reading upstream",
          "postgres|checkpoint complete: wrote {n} buffers",
          "kernel|Out of memory: Killed process {pid2}",
          "systemd|Started Daily apt download activities.",
          "dockerd|container {hex} health status changed to healthy",
          "rsyslogd|imuxsock lost {n} messages",
          "chronyd|System clock wrong by {n} ms, adjusting",
          "haproxy|backend api{n2} is DOWN, reason: Layer4 timeout",
          "redis|Background saving started by pid {pid2}",
          "certbot|Certificate renewal skipped, not due",
          "sshd|Failed password for invalid user {user} from {ip} port {port}",
          "login|pam_unix session opened for {user}",
          "postgres|autovacuum: processing table orders",
          "kernel|eth0: link up, 10000 Mbps full duplex",
          "nginx|Reloading configuration",
          "gunicorn|worker {n2} exited on signal 9",
          "mysqld|slow query ({n} ms): select * from events where id > ?",
          "systemd-logind|Stopped Session {n2} of user {user}."],
)


def syslog_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    mon, day = rng.choice(MONTHS), rng.randint(1, 28)
    t = rng.randint(0, 20 * 3600)
    net, zone = v.pick(rng, "nets"), v.pick(rng, "zones")
    clients = [f"{net}.{rng.randint(0, 255)}.{rng.randint(1, 254)}" for _ in range(6)]
    while True:
        host = v.pick(rng, "hosts")
        at = {"stamp": f"{mon} {day:2d} {hms(t)}", "host": host, "pid": rng.randint(300, 65000),
              "ip": rng.choice(clients), "http_time": f"{day:02d}/{mon}/2026:{hms(t)} {zone}"}
        if rng.random() < 0.35:
            st = rng.choice([200, 200, 200, 200, 301, 304, 404, 500, 502])
            text = (f"{at['ip']} - - [{at['http_time']}] \"{rng.choice(['GET', 'GET', 'POST', 'PUT'])} "
                    f"{v.pick(rng, 'paths')} HTTP/1.1\" {st} {rng.randint(80, 90000)} \"-\" \"{v.pick(rng, 'agents')}\"")
        else:
            d, msg = rng.choice(v["msgs"]).split("|", 1)
            msg = msg.format(user=v.pick(rng, "users"), ip=rng.choice(clients),
                                               port=rng.randint(1024, 65535), n=rng.randint(2, 9000),
                                               n2=rng.randint(1, 40), pid2=rng.randint(300, 65000),
                                               hex=f"{rng.getrandbits(48):012x}")
            text = f"{at['stamp']} {host} {d}[{at['pid']}]: {msg}"
        yield Unit(text + "\n", at)
        t += rng.randint(0, 40)


# ----------------------------------------------------------------------------- legal (contract clauses)
LEGAL = dict(
    parties=[("the Supplier", "the Customer"), ("the Licensor", "the Licensee"), ("the Landlord", "the Tenant"),
             ("the Contractor", "the Client"), ("the Lender", "the Borrower"), ("the Agency", "the Publisher"),
             ("the Carrier", "the Shipper"), ("the Consultant", "the Company")],
    articles=["DEFINITIONS", "TERM AND TERMINATION", "PAYMENT", "CONFIDENTIALITY", "LIABILITY", "WARRANTIES",
              "INTELLECTUAL PROPERTY", "NOTICES", "FORCE MAJEURE", "GOVERNING LAW", "ASSIGNMENT", "INSURANCE"],
    clauses=["{X} shall pay each invoice within {n} days of its date of issue.",
             "Either party may terminate this Agreement on {n} days' written notice to the other.",
             "{Y} shall keep all Confidential Information in strict confidence and use it only for the Purpose.",
             "Nothing in this Agreement limits liability for death or personal injury caused by negligence.",
             "{X} warrants that the Services will be performed with reasonable skill and care.",
             "All notices shall be in writing and delivered by hand, by courier or by registered post.",
             "{Y} shall not assign or transfer any of its rights without the prior written consent of {X}.",
             "Late payments bear interest at {n} per cent per annum above the base rate.",
             "Neither party is liable for delay caused by events beyond its reasonable control.",
             "This Agreement is governed by the laws of the jurisdiction named in Schedule {n2}.",
             "{X} retains all intellectual property rights in the Materials.",
             "{Y} shall maintain insurance cover of not less than {n},000 units for the Term.",
             "The obligations in this clause survive termination for a period of {n} months.",
             "Any amendment to this Agreement must be signed by an authorised officer of each party.",
             "{Y} may audit the relevant records once in any twelve-month period on reasonable notice.",
             "If any provision is held invalid, the remaining provisions continue in full force.",
             "Time is of the essence for the delivery dates set out in Schedule {n2}.",
             "{X} shall remedy any defect notified within {n} days at its own cost.",
             "The headings in this Agreement are for convenience only and do not affect its meaning.",
             "{Y} indemnifies {X} against losses arising from its breach of this clause."],
)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def legal_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    x, y = v.pick(rng, "parties")
    art = 1
    yield Unit(f"AGREEMENT between {x[4:]} and {y[4:]}, dated the {_ordinal(rng.randint(1, 28))} day of "
               f"{rng.choice(['March', 'June', 'October', 'January'])} {rng.randint(2001, 2030)}\n\n", {})
    while True:
        yield Unit(f"ARTICLE {art}. {v.pick(rng, 'articles')}\n\n", {"art": art})
        for k, c in enumerate(rng.sample(v["clauses"], rng.randint(2, 7)), 1):
            c = c.format(X=x, Y=y, n=rng.randint(5, 90), n2=rng.randint(1, 6))
            yield Unit(f"{art}.{k} {cap(c)}\n\n", {"art": art})
        art += 1


# ----------------------------------------------------------------------------- email (threads)
EMAIL = dict(
    people=[("Greta Holm", "greta.holm"), ("Malik Osei", "m.osei"), ("Ines Carvalho", "ines.c"),
            ("Tobias Wendt", "t.wendt"), ("Leila Haddad", "leila"), ("Piotr Zielinski", "pz"),
            ("Akosua Mensah", "akosua.m"), ("Henrik Dahl", "hdahl"), ("Sofia Rinaldi", "s.rinaldi"),
            ("Kenji Mori", "kmori"), ("Ayla Demir", "ayla.d"), ("Rowan Price", "rprice")],
    domains=["example.org", "mail.test", "corp.example", "lists.example.net"],
    subjects=["quarterly budget draft", "venue for the offsite", "printer contract renewal",
              "onboarding checklist", "volunteer rota for May", "supplier invoice query", "roof repair quotes",
              "conference travel", "new office keys", "board meeting minutes", "data retention policy",
              "holiday schedule"],
    body=["Thanks for sending this over.", "I've had a first look and added comments in the margin.",
          "Could we move the call to Thursday afternoon?", "The figures in section two still look off to me.",
          "I spoke to facilities and they can do it next week.", "Please see the attached version.",
          "Let me know if anything is unclear.", "I'm out of the office until Monday.",
          "We agreed to keep the existing supplier for now.", "Can you confirm the numbers before Friday?",
          "Happy to help with the next draft.", "Adding {name} in copy for visibility.",
          "I don't think we need a vote on this.", "The deadline moved, so there is less rush.",
          "Sorry for the slow reply, it has been a busy week.", "Sounds good to me, go ahead."],
    zones=["+0000", "+0200", "+0100", "-0500", "+0530", "-0800"],
    closings=["Best,", "Thanks,", "Cheers,", "Kind regards,", "All the best,", "Regards,"],
)


def email_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    subj = v.pick(rng, "subjects")
    dom, zone = v.pick(rng, "domains"), v.pick(rng, "zones")
    day, t = rng.randint(1, 28), rng.randint(8 * 3600, 17 * 3600)
    re_ = ""
    while True:
        (name, user), (name2, user2) = rng.sample(v["people"], 2)
        at = {"name": name, "name2": name2, "first": name.split()[0], "subject": subj}
        for h in (f"From: {name} <{user}@{dom}>", f"To: {name2} <{user2}@{dom}>",
                  f"Date: {rng.choice(WEEKDAYS)}, {day} {rng.choice(MONTHS)} 2026 {hms(t)} {zone}",
                  f"Subject: {re_}{subj}"):
            yield Unit(h + "\n", at)
        yield Unit("\n", at)
        yield Unit(f"Hi {name2.split()[0]},\n\n", at)
        for _ in range(rng.randint(2, 6)):
            yield Unit(rng.choice(v["body"]).format(name=rng.choice(v["people"])[0]) + "\n", at)
        yield Unit(f"\n{rng.choice(v['closings'])}\n{name.split()[0]}\n\n", at)
        if rng.random() < 0.5:
            yield Unit(f"> {rng.choice(v['body']).format(name=name2)}\n\n", at)
        re_ = "Re: "
        t += rng.randint(600, 20000)


# ----------------------------------------------------------------------------- config (YAML)
CONFIG = dict(
    sections=["server", "database", "cache", "logging", "auth", "queue", "storage", "metrics", "mailer", "scheduler",
              "search", "payments"],
    keys=["host", "port", "timeout_s", "retries", "pool_size", "enabled", "region", "bucket", "level", "format",
          "max_connections", "ttl_s", "replicas", "batch_size", "interval_s", "endpoint", "verify_tls", "workers",
          "backoff_ms", "queue_depth"],
    words=["primary", "eu-west", "json", "info", "warn", "internal", "blue", "green", "archive", "fast",
           "standard", "us-east", "debug", "plain", "nightly", "hourly"],
    comments=["# values below are overridden per environment", "# keep in sync with the deployment chart",
              "# do not lower this without a load test", "# seconds, not milliseconds",
              "# defaults from the vendor documentation", "# raised after the spring incident",
              "# only read at startup", "# set to false in local development"],
)


def config_units(rng: random.Random, v: Vocab) -> Iterator[Unit]:
    yield Unit(f"# service configuration, revision {rng.randint(2, 400)}\n", {"indent": ""})
    while True:
        sec = v.pick(rng, "sections")
        yield Unit(f"{sec}:\n", {"indent": ""})
        if rng.random() < 0.3:
            yield Unit("  " + v.pick(rng, "comments") + "\n", {"indent": "  "})
        for key in rng.sample(v["keys"], rng.randint(3, 8)):
            val = rng.choice([str(rng.randint(1, 5000)), v.pick(rng, "words"), rng.choice(["true", "false"]),
                              f"\"{v.pick(rng, 'words')}-{rng.randint(1, 99)}\""])
            yield Unit(f"  {key}: {val}\n", {"indent": "  "})
        if rng.random() < 0.4:
            sub = v.pick(rng, "sections")
            yield Unit(f"  {sub}:\n", {"indent": "  "})
            for key in rng.sample(v["keys"], rng.randint(2, 4)):
                yield Unit(f"    {key}: {rng.randint(1, 900)}\n", {"indent": "    "})


GENERATORS = {
    "code": (CODE, code_units, "Python-like source: functions, classes, comments, docstrings"),
    "chat": (CHAT, chat_units, "a multi-speaker chat log with timestamps and join lines"),
    "csv": (CSV, csv_units, "CSV tables (shipments, inventory, payroll, ...) full of ids and numbers"),
    "wiki": (WIKI, wiki_units, "encyclopedic articles on invented places, with years and figures"),
    "manual": (MANUAL, manual_units, "numbered instructions: appliance care and recipes"),
    "fiction": (FICTION, fiction_units, "fiction in chapters, narration and quoted dialogue"),
    "syslog": (SYSLOG, syslog_units, "syslog lines and HTTP access-log lines"),
    "legal": (LEGAL, legal_units, "contract articles and numbered clauses"),
    "email": (EMAIL, email_units, "an e-mail thread: headers, bodies, quoted replies"),
    "config": (CONFIG, config_units, "YAML configuration: sections, keys, comments"),
}
