"""A generated world of documents to teach document QA: entities across domains, each with
facts (a year, a town, a person, a measure, a feature) written in varied sentences, and
look-alike entities (a shared name word, other facts) to tell apart.

Everything is drawn from a :class:`random.Random` the caller seeds, so the same seed gives the
same world. Names are composed from syllables and word lists that share nothing with the
sample corpus or the eval's tool sets (tests check both).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Domains whose documents and questions are never trained on (the held-out split by domain).
HELD_OUT_DOMAINS = ("observatory", "vineyard", "ferry_company")


@dataclass(frozen=True)
class Domain:
    key: str
    noun: str  # "lighthouse"
    suffixes: tuple[str, ...]  # name endings: "Light", "Lighthouse"
    role: str  # who leads it: "keeper"
    measure: str  # sentence with {name} and {value}
    measure_question: str  # question with {name}
    measure_unit: str  # appended to the number in answers
    measure_range: tuple[int, int]
    features: tuple[str, ...]  # what it is known for
    filler: tuple[str, ...]  # sentences with {name} that state no asked fact


DOMAINS: tuple[Domain, ...] = (
    Domain(
        "lighthouse",
        "lighthouse",
        ("Light", "Lighthouse", "Point Light"),
        "keeper",
        "The tower of {name} stands {value} metres above the rocks.",
        "How tall is {name}?",
        "metres",
        (12, 68),
        ("a red-and-white spiral", "a foghorn nicknamed the Bellow", "a brass Fresnel lens", "its shipwreck museum"),
        ("Storms reach {name} most winters.", "Boats pass {name} on their way to the outer banks.", "Guided walks to {name} run in summer."),
    ),
    Domain(
        "brewery",
        "brewery",
        ("Brewery", "Brewing Company", "Ales"),
        "head brewer",
        "{name} brews about {value} barrels a year.",
        "How many barrels a year does {name} brew?",
        "barrels",
        (800, 42000),
        ("a smoked porter", "a cloudy wheat beer", "a barley wine aged in oak", "a sour cherry ale"),
        ("The taproom at {name} opens in the afternoon.", "{name} buys its malt from nearby farms.", "Tours of {name} end in the tasting room."),
    ),
    Domain(
        "observatory",
        "observatory",
        ("Observatory", "Astronomical Station"),
        "director",
        "The main telescope at {name} has a mirror {value} centimetres across.",
        "How wide is the main telescope mirror at {name}?",
        "centimetres",
        (40, 420),
        ("its comet survey", "a meteorite collection", "a public planetarium", "its variable-star catalogue"),
        ("Clear nights at {name} are booked months ahead.", "Students from several colleges observe at {name}.", "{name} shuts its dome in high wind."),
    ),
    Domain(
        "rail_line",
        "railway line",
        ("Railway", "Line", "Branch Line"),
        "general manager",
        "Trains on {name} cover {value} kilometres of track.",
        "How long is {name}?",
        "kilometres",
        (9, 310),
        ("a viaduct of forty arches", "its restored steam engines", "a spiral tunnel", "a dining car"),
        ("Timetables for {name} change in spring.", "{name} carries freight at night.", "Volunteers repaint the stations of {name}."),
    ),
    Domain(
        "orchestra",
        "orchestra",
        ("Orchestra", "Philharmonic", "Symphony Orchestra"),
        "principal conductor",
        "{name} has {value} regular players.",
        "How many regular players does {name} have?",
        "players",
        (28, 110),
        ("its summer concerts in a quarry", "recordings of forgotten operas", "a youth academy", "a festival of new music"),
        ("Rehearsals of {name} are open on Thursdays.", "{name} tours abroad every other year.", "Tickets for {name} sell out quickly."),
    ),
    Domain(
        "vineyard",
        "vineyard",
        ("Estate", "Vineyard", "Wine Cellars"),
        "winemaker",
        "{name} covers {value} hectares of vines.",
        "How many hectares of vines does {name} cover?",
        "hectares",
        (3, 180),
        ("a late-harvest white", "its sparkling rosé", "a cellar cut into chalk", "an old-vine red"),
        ("Harvest at {name} begins in late summer.", "{name} welcomes visitors at weekends.", "Frost nets protect the slopes of {name}."),
    ),
    Domain(
        "hospital",
        "hospital",
        ("Hospital", "Infirmary", "Medical Centre"),
        "chief executive",
        "{name} has {value} beds.",
        "How many beds does {name} have?",
        "beds",
        (40, 1400),
        ("its burns unit", "a children's heart clinic", "a teaching library", "its rooftop helipad"),
        ("Parking at {name} is limited.", "{name} trains nurses from the region.", "Visiting hours at {name} end at eight."),
    ),
    Domain(
        "football_club",
        "football club",
        ("FC", "Athletic", "Rovers", "United"),
        "manager",
        "The ground of {name} holds {value} spectators.",
        "How many spectators does the ground of {name} hold?",
        "spectators",
        (900, 61000),
        ("a cup run to the final", "its academy of young players", "green-and-gold stripes", "a famous terrace song"),
        ("Supporters of {name} travel in numbers.", "{name} trains on pitches outside town.", "The club shop of {name} sells scarves."),
    ),
    Domain(
        "software_library",
        "software library",
        ("Lib", "Kit", "Toolkit", "Engine"),
        "lead maintainer",
        "{name} has {value} contributors.",
        "How many contributors does {name} have?",
        "contributors",
        (3, 2400),
        ("fast parsing of log files", "its plugin system", "bindings for many languages", "a tiny memory footprint"),
        ("Releases of {name} follow a fixed calendar.", "{name} keeps its documentation online.", "Bug reports for {name} are triaged weekly."),
    ),
    Domain(
        "bridge",
        "bridge",
        ("Bridge", "Crossing", "Viaduct"),
        "chief engineer",
        "The main span of {name} is {value} metres long.",
        "How long is the main span of {name}?",
        "metres",
        (30, 1900),
        ("its suspension cables", "a lifting middle section", "painted iron lattice", "its toll house"),
        ("Traffic on {name} slows at rush hour.", "{name} is closed for inspection each spring.", "Cyclists use a lane on {name}."),
    ),
    Domain(
        "museum",
        "museum",
        ("Museum", "Gallery", "Collection"),
        "curator",
        "{name} holds about {value} objects.",
        "How many objects does {name} hold?",
        "objects",
        (400, 95000),
        ("a carved whalebone chess set", "its map room", "an early printing press", "a hall of clocks"),
        ("Entry to {name} is free on Sundays.", "School groups visit {name} every week.", "The café at {name} faces the garden."),
    ),
    Domain(
        "festival",
        "festival",
        ("Festival", "Fair", "Carnival"),
        "artistic director",
        "{name} draws around {value} visitors.",
        "How many visitors does {name} draw?",
        "visitors",
        (1200, 250000),
        ("a lantern parade", "its street theatre", "a folk-song contest", "a fireworks finale"),
        ("Stalls line the streets during {name}.", "{name} relies on volunteers.", "Buses run late while {name} is on."),
    ),
    Domain(
        "ferry_company",
        "ferry company",
        ("Ferries", "Ferry Company", "Sea Link"),
        "managing director",
        "{name} runs {value} crossings a week.",
        "How many crossings a week does {name} run?",
        "crossings",
        (6, 140),
        ("a car deck for lorries", "its night sailings", "an island mail service", "a fleet of catamarans"),
        ("Crossings with {name} are cancelled in gales.", "{name} sells season tickets.", "The terminal of {name} has a waiting room."),
    ),
    Domain(
        "mine",
        "mine",
        ("Mine", "Colliery", "Quarry"),
        "mine manager",
        "The deepest shaft of {name} reaches {value} metres.",
        "How deep is the deepest shaft of {name}?",
        "metres",
        (40, 1600),
        ("its tin lodes", "an underground chapel", "a winding engine still in use", "its miners' band"),
        ("Pumps keep {name} dry.", "{name} once employed most of the valley.", "Tours of {name} need a helmet."),
    ),
    Domain(
        "airline",
        "airline",
        ("Air", "Airways", "Aviation"),
        "chief executive",
        "{name} flies {value} aircraft.",
        "How many aircraft does {name} fly?",
        "aircraft",
        (2, 240),
        ("its island hops", "a livery with a painted heron", "cheap night flights", "seaplanes"),
        ("Delays at {name} are rare.", "{name} serves meals on longer routes.", "Pilots of {name} train in the capital."),
    ),
)
DOMAIN_BY_KEY = {d.key: d for d in DOMAINS}

_ONSETS = ("Br", "Dr", "Gl", "K", "Qu", "Th", "V", "Z", "Sk", "Tr", "Fl", "Pr", "St", "Wh", "Cr", "Sn", "Gr", "Bl", "H", "N")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("ndle", "rrow", "lby", "mmer", "stow", "wick", "thorn", "rvel", "ggan", "nsey", "lmore", "dric", "ppin", "sker")
_GIVEN = (
    "Ilse",
    "Tobiah",
    "Marisol",
    "Kwame",
    "Oona",
    "Pavel",
    "Rukmini",
    "Soren",
    "Yetunde",
    "Emeric",
    "Zofia",
    "Alvar",
    "Niamh",
    "Ignatius",
    "Leocadia",
    "Bartholomew",
    "Ximena",
    "Gunnar",
    "Leontyne",
    "Tadeo",
)
_FAMILY = (
    "Ferrand",
    "Adeyemi",
    "Halvorsen",
    "Petrakis",
    "Loughlin",
    "Vasquez-Reid",
    "Drummond",
    "Ishikawa",
    "Bellweather",
    "Castellanos",
    "Mbeki",
    "Lindgren",
    "Abernathy",
    "Rosetti",
    "Kowalczyk",
    "Thistlewood",
    "Nakamura",
    "Delacroix",
    "Oyelaran",
    "Quarrington",
)


def _word(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def town(rng: random.Random) -> str:
    return _word(rng) + rng.choice(("", " Cross", " Bay", " Hill", "ford", "mouth", " Vale"))


def person(rng: random.Random) -> str:
    return f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"


@dataclass
class Entity:
    domain: Domain
    name: str
    stem: str  # the name word look-alikes share
    facts: dict[str, str]  # attribute -> value as written in the document and the answer
    leader_since: int
    filler_picks: list[str] = field(default_factory=list)


ATTRIBUTES = ("year", "place", "leader", "measure", "feature", "time")


def make_entity(rng: random.Random, domain: Domain, stem: str | None = None, avoid: Entity | None = None) -> Entity:
    """One entity; with ``stem`` (and ``avoid``) a look-alike: the same stem, another suffix or
    qualifier, and facts that differ from ``avoid``'s."""
    stem = stem or _word(rng)
    while True:
        qualifier = rng.choice(("", "", "North ", "Old ", "New ", "Upper ", "East "))
        name = f"{qualifier}{stem} {rng.choice(domain.suffixes)}"
        if avoid is None or name != avoid.name:
            break
    while True:
        low, high = domain.measure_range
        facts = {
            "year": str(rng.randint(1790, 2015)),
            "place": town(rng),
            "leader": person(rng),
            "measure": f"{rng.randint(low, high):,}",
            "feature": rng.choice(domain.features),
            "time": f"{rng.randint(5, 11)}:{rng.choice(('00', '15', '20', '30', '40', '45'))} a.m.",
        }
        if avoid is None or all(facts[k] != avoid.facts[k] for k in ("year", "place", "leader", "measure", "time")):
            break
    since = rng.randint(max(int(facts["year"]), 1960), 2024)
    return Entity(domain, name, stem, facts, since)


_YEAR_SENTENCES = (
    "{name} was founded in {year}.",
    "{name} opened in {year}.",
    "Records show {name} was established in {year}.",
    "The story of {name} begins in {year}, the year it was founded.",
)
_PLACE_SENTENCES = (
    "{name} is based in {place}.",
    "You will find {name} in {place}.",
    "{name} stands on the edge of {place}.",
    "The home of {name} is the town of {place}.",
)
_LEADER_SENTENCES = (
    "{leader} has been {role} of {name} since {since}.",
    "Since {since} the {role} of {name} has been {leader}.",
    "{name} is run by {leader}, its {role} since {since}.",
)
_TIME_SENTENCES = ("On weekdays {name} opens at {time}.", "The doors of {name} open at {time} on weekdays.", "{name} starts its weekday at {time}.")
_FEATURE_SENTENCES = ("{name} is best known for {feature}.", "Most people know {name} for {feature}.", "{name} is famous for {feature}.")


def document_text(rng: random.Random, entity: Entity) -> str:
    """A paragraph stating every fact of ``entity`` in shuffled order with filler between."""
    d, f, name = entity.domain, entity.facts, entity.name
    sentences = [
        rng.choice(_YEAR_SENTENCES).format(name=name, year=f["year"]),
        rng.choice(_PLACE_SENTENCES).format(name=name, place=f["place"]),
        rng.choice(_LEADER_SENTENCES).format(name=name, leader=f["leader"], role=d.role, since=entity.leader_since),
        d.measure.format(name=name, value=f["measure"]),
        rng.choice(_FEATURE_SENTENCES).format(name=name, feature=f["feature"]),
        rng.choice(_TIME_SENTENCES).format(name=name, time=f["time"]),
    ]
    rng.shuffle(sentences)
    fillers = rng.sample(d.filler, k=rng.randint(1, len(d.filler)))
    for filler in fillers:
        sentences.insert(rng.randint(1, len(sentences)), filler.format(name=name))
    return " ".join(sentences)


def title(entity: Entity) -> str:
    return entity.name
