"""Tool-decision examples in the engine's tool format (the chat template's, or the documented
fallback :data:`snapkv_rag.engine.prompts.FALLBACK_TOOL_PROMPT`, exactly as inference renders it).

Each example offers 2-5 generated tools and a user turn that needs one of them, two of them,
or none (small talk, facts, writing help), or a tool that is not offered (then no call), or
continues after a tool result that the answer must use. Calls are written by
:func:`snapkv_rag.tools.calls.format_call`, exactly as constrained decoding writes them.

Held out by tool (:data:`HELD_OUT_TOOLS`) and by template (the last request template of each
tool, the last no-tool template): the training split uses neither. The eval's tool sets
(eval/agents/tool_decisions.py) share no tool name with these (a test checks).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..lookalike_world import person, town
from ..tools.calls import format_call
from .examples import Example


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object", "properties": properties, "required": required}},
    }


def _s(*names: str) -> dict[str, Any]:
    return {n: {"type": "string"} for n in names}


Draw = Callable[[random.Random], dict[str, Any]]


@dataclass(frozen=True)
class ToolFamily:
    schema: dict[str, Any]
    draw: Draw  # the arguments of one request
    requests: tuple[str, ...]  # user turns, formatted with the arguments; the last is held out
    result: Callable[[random.Random, dict[str, Any]], dict[str, Any]]  # a tool result for those arguments
    reply: str  # the answer from a result, formatted with arguments and result

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


_LANGS = ("French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Polish", "Swedish")
_PHRASES = ("good evening", "where is the station", "thank you very much", "the bill, please", "I am lost", "see you tomorrow")
_CITIES = ("Lisbon", "Nairobi", "Montreal", "Osaka", "Krakow", "Valparaiso", "Hanoi", "Tallinn", "Perth", "Quito")
_UNITS = (("miles", "kilometres"), ("pounds", "kilograms"), ("feet", "metres"), ("gallons", "litres"), ("inches", "centimetres"))
_DISHES = ("mushroom risotto", "lentil soup", "banana bread", "fish tacos", "vegetable curry", "apple crumble")
_TOPICS = ("solar power", "local elections", "the chess olympiad", "coral reefs", "space launches", "electric buses")
_SONGS = ("rainy day jazz", "upbeat running music", "classical piano", "80s pop", "lo-fi beats")
_CARRIERS = ("NordPost", "QuickShip", "ParcelGo")


def _flight(rng: random.Random) -> dict[str, Any]:
    return {"flight_number": f"{rng.choice(('KL', 'TP', 'QF', 'AC', 'LO'))}{rng.randint(100, 1999)}"}


FAMILIES: tuple[ToolFamily, ...] = (
    ToolFamily(
        _fn("translate_text", "Translate a piece of text into another language.", _s("text", "target_language"), ["text", "target_language"]),
        lambda r: {"text": r.choice(_PHRASES), "target_language": r.choice(_LANGS)},
        (
            "Translate '{text}' into {target_language}.",
            "How do you say '{text}' in {target_language}?",
            "{target_language} for '{text}', please.",
            "I need '{text}' in {target_language}.",
        ),
        lambda r, a: {"translation": f"<{a['target_language']} text>"},
        "In {target_language}, '{text}' is {translation}.",
    ),
    ToolFamily(
        _fn("get_flight_status", "Look up the live status of a flight by its flight number.", _s("flight_number"), ["flight_number"]),
        _flight,
        (
            "Is flight {flight_number} on time?",
            "What's the status of {flight_number}?",
            "Has {flight_number} landed yet?",
            "Check flight {flight_number} for me.",
        ),
        lambda r, a: {"status": r.choice(("on time", "delayed by 40 minutes", "landed", "boarding"))},
        "Flight {flight_number} is {status}.",
    ),
    ToolFamily(
        _fn(
            "convert_units",
            "Convert a quantity from one unit of measurement to another.",
            {"value": {"type": "number"}, **_s("from_unit", "to_unit")},
            ["value", "from_unit", "to_unit"],
        ),
        lambda r: dict(zip(("from_unit", "to_unit"), r.choice(_UNITS)), value=r.randint(2, 500)),
        (
            "Convert {value} {from_unit} to {to_unit}.",
            "How many {to_unit} is {value} {from_unit}?",
            "{value} {from_unit} in {to_unit}?",
            "What is {value} {from_unit} expressed in {to_unit}?",
        ),
        lambda r, a: {"result": round(a["value"] * r.uniform(0.3, 3), 2)},
        "{value} {from_unit} is {result} {to_unit}.",
    ),
    ToolFamily(
        _fn("find_recipe", "Find a recipe for a dish.", _s("dish"), ["dish"]),
        lambda r: {"dish": r.choice(_DISHES)},
        ("Find me a recipe for {dish}.", "How do I make {dish}? Look up a recipe.", "I want to cook {dish} tonight, get me a recipe.", "Recipe for {dish}?"),
        lambda r, a: {"title": f"Easy {a['dish']}", "minutes": r.choice((25, 40, 55, 90))},
        "I found 'Easy {dish}', which takes {minutes} minutes.",
    ),
    ToolFamily(
        _fn("get_news", "Get the latest news headlines on a topic.", _s("topic"), ["topic"]),
        lambda r: {"topic": r.choice(_TOPICS)},
        ("What's the latest news on {topic}?", "Any headlines about {topic} today?", "Give me today's news about {topic}.", "Catch me up on {topic} news."),
        lambda r, a: {"headline": f"New report on {a['topic']} published"},
        "The latest headline on {topic}: {headline}.",
    ),
    ToolFamily(
        _fn("track_package", "Track a parcel by carrier and tracking number.", _s("carrier", "tracking_number"), ["tracking_number"]),
        lambda r: {"carrier": r.choice(_CARRIERS), "tracking_number": f"{r.randint(10**9, 10**10 - 1)}"},
        (
            "Where is my {carrier} parcel {tracking_number}?",
            "Track package {tracking_number} with {carrier}.",
            "Has {carrier} delivered {tracking_number} yet?",
            "Status of {carrier} shipment {tracking_number}?",
        ),
        lambda r, a: {"location": town(r), "eta": r.choice(("tomorrow", "Friday", "12 March"))},
        "Parcel {tracking_number} is in {location} and should arrive {eta}.",
    ),
    ToolFamily(
        _fn("play_music", "Play music on the user's speaker.", _s("query"), ["query"]),
        lambda r: {"query": r.choice(_SONGS)},
        ("Play some {query}.", "Put on {query}, please.", "I'd like to listen to {query}.", "Music: {query}."),
        lambda r, a: {"playing": f"{a['query']} mix"},
        "Now playing: {playing}.",
    ),
    ToolFamily(
        _fn("get_definition", "Look up the dictionary definition of a word.", _s("word"), ["word"]),
        lambda r: {"word": r.choice(("petrichor", "sonder", "apricity", "vellichor", "hiraeth", "limerence"))},
        (
            "Look up the definition of '{word}'.",
            "What does the word {word} mean? Check the dictionary.",
            "Dictionary entry for {word}, please.",
            "Define {word} using the dictionary.",
        ),
        lambda r, a: {"definition": f"the dictionary sense of {a['word']}"},
        "The dictionary defines '{word}' as {definition}.",
    ),
    ToolFamily(
        _fn("check_train_times", "List departures between two stations.", _s("from_station", "to_station"), ["from_station", "to_station"]),
        lambda r: dict(zip(("from_station", "to_station"), r.sample(_CITIES, 2))),
        (
            "When are the trains from {from_station} to {to_station}?",
            "Next train {from_station} to {to_station}?",
            "Show departures from {from_station} to {to_station}.",
            "I need a train from {from_station} to {to_station}.",
        ),
        lambda r, a: {"next_departure": f"{r.randint(6, 22)}:{r.choice(('05', '20', '45'))}"},
        "The next train from {from_station} to {to_station} leaves at {next_departure}.",
    ),
    ToolFamily(
        _fn("set_reminder", "Set a reminder with a message at a given time.", _s("message", "time"), ["message", "time"]),
        lambda r: {
            "message": r.choice(("call the dentist", "water the plants", "pay rent", "pick up the dry cleaning")),
            "time": r.choice(("9am", "6:30pm", "noon")),
        },
        (
            "Remind me to {message} at {time}.",
            "Set a reminder at {time}: {message}.",
            "At {time}, remind me I have to {message}.",
            "Can you make sure I remember to {message} at {time}?",
        ),
        lambda r, a: {"ok": True},
        "Done: I'll remind you to {message} at {time}.",
    ),
    ToolFamily(
        _fn("lookup_contact", "Find a person's phone number and e-mail in the address book.", _s("name"), ["name"]),
        lambda r: {"name": person(r)},
        ("What's {name}'s phone number?", "Find {name} in my contacts.", "Look up the e-mail address of {name}.", "How do I reach {name}?"),
        lambda r, a: {"phone": f"+44 {r.randint(1000, 9999)} {r.randint(100000, 999999)}"},
        "{name}'s number is {phone}.",
    ),
    ToolFamily(
        _fn("get_air_quality", "Get the air-quality index of a city.", _s("city"), ["city"]),
        lambda r: {"city": r.choice(_CITIES)},
        ("How is the air quality in {city}?", "What's the AQI in {city} right now?", "Is the air clean in {city} today?", "Air pollution level in {city}?"),
        lambda r, a: {"aqi": r.randint(10, 180)},
        "The air-quality index in {city} is {aqi}.",
    ),
    ToolFamily(
        _fn("roll_dice", "Roll dice and return the results.", {"count": {"type": "integer"}, "sides": {"type": "integer"}}, ["count", "sides"]),
        lambda r: {"count": r.randint(1, 4), "sides": r.choice((6, 8, 10, 20))},
        ("Roll {count} d{sides}.", "Throw {count} dice with {sides} sides.", "Give me a roll of {count} {sides}-sided dice.", "Dice: {count}d{sides}."),
        lambda r, a: {"rolls": [r.randint(1, a["sides"]) for _ in range(a["count"])]},
        "You rolled {rolls}.",
    ),
    ToolFamily(
        _fn("get_opening_hours", "Get the opening hours of a shop or office.", _s("place"), ["place"]),
        lambda r: {"place": r.choice(("the town library", "the post office", "the swimming pool", "the pharmacy"))},
        ("When does {place} open?", "What are the opening hours of {place}?", "Is {place} open now?", "Hours for {place}?"),
        lambda r, a: {"hours": r.choice(("9:00-17:00", "8:30-20:00", "10:00-16:00"))},
        "{place} is open {hours}.",
    ),
    ToolFamily(
        _fn("create_note", "Save a note in the user's notebook.", _s("title", "text"), ["text"]),
        lambda r: {
            "title": r.choice(("groceries", "ideas", "meeting")),
            "text": r.choice(("buy oat milk and lemons", "try the night market", "ask about the budget")),
        },
        (
            "Make a note titled {title}: {text}.",
            "Save this in my notes under {title}: {text}.",
            "Note to self ({title}): {text}.",
            "Write down '{text}' in my {title} note.",
        ),
        lambda r, a: {"saved": True},
        "Saved your {title} note.",
    ),
    ToolFamily(
        _fn("search_web", "Search the web for pages matching a query.", _s("query"), ["query"]),
        lambda r: {"query": r.choice(("cheap flights to Lisbon", "best hiking boots 2026", "how to repot an orchid", "local farmers market hours"))},
        ("Search the web for {query}.", "Google {query} for me.", "Find pages about {query} online.", "Look up {query} on the internet."),
        lambda r, a: {"top_result": f"A guide to {a['query']}"},
        "The top result for '{query}' is '{top_result}'.",
    ),
)
# Names each tool is offered under (the first is its own): the model learns to call the tool the
# listing names, not a name it memorized.
ALIASES: dict[str, tuple[str, ...]] = {
    "translate_text": ("translate", "text_translator"),
    "get_flight_status": ("flight_status", "check_flight"),
    "convert_units": ("unit_converter", "convert_measurement"),
    "find_recipe": ("recipe_search", "get_recipe"),
    "get_news": ("news_headlines", "latest_news"),
    "track_package": ("parcel_tracker", "package_status"),
    "play_music": ("music_player", "play_song"),
    "get_definition": ("dictionary_lookup", "define_word"),
    "check_train_times": ("train_departures", "rail_timetable"),
    "set_reminder": ("create_reminder", "remind_me"),
    "lookup_contact": ("find_contact", "address_book"),
    "get_air_quality": ("air_quality_index", "aqi_lookup"),
    "roll_dice": ("dice_roller", "random_dice"),
    "get_opening_hours": ("opening_hours", "business_hours"),
    "create_note": ("save_note", "notebook_add"),
    "search_web": ("web_search", "internet_search"),
}
GENERAL_TOOLS = ("search_web",)
HELD_OUT_TOOLS = ("get_air_quality", "check_train_times", "create_note", "roll_dice")
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}

# Requests that need no tool, and their answers; the last is held out.
NO_TOOL: tuple[tuple[str, str], ...] = (
    ("Nice to meet you!", "Nice to meet you too! What can I do for you?"),
    ("I appreciate the quick help.", "Glad I could help! Anything else?"),
    ("Which river flows through Vienna?", "The Danube flows through Vienna."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Subtract 19 from 50.", "50 minus 19 is 31."),
    ("Can you think of a title for a short story about a lost key?", "How about 'The Key Under the Stairs'?"),
    ("Write a one-line thank-you message for a colleague.", "Thank you for all your help this week, it made a real difference!"),
    ("What does a thermometer measure?", "A thermometer measures temperature."),
    ("What do bees make?", "Bees make honey and wax."),
    ("How can I keep basil fresh longer?", "Keep the stems in a glass of water at room temperature, like cut flowers."),
    ("What colour do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
    ("How many minutes are in two hours?", "Two hours have 120 minutes."),
    ("Which instrument has 88 keys?", "A standard piano has 88 keys."),
    ("What's a good way to remember a new password?", "Turn it into a short phrase you can picture, and store it in a password manager."),
    ("How many sides does a hexagon have?", "A hexagon has six sides."),
    ("Spell the word 'necessary' backwards.", "Backwards, 'necessary' is 'yrassecen'."),
)


UNAVAILABLE = "I can't do that: none of the tools I have here can."

# Recipe 4: requests on the topic of an offered tool that the tool does not serve (the adapter of
# recipe 3 called a tool on 9 of 45 such prompts). Keyed by the tool offered with them; the held-out
# tools' requests are drawn only by the held-out split.
NEAR_MISS: dict[str, tuple[tuple[str, str], ...]] = {
    "translate_text": (
        (
            "Why do some languages have gendered nouns?",
            "Gendered nouns are a grammatical habit inherited from older languages; they sort nouns into classes that agree with articles and adjectives.",
        ),
        (
            "Is it easier to learn Spanish or Italian?",
            "Both are close to each other; Spanish has simpler spelling, Italian clearer vowels, so pick the one you will practise more.",
        ),
    ),
    "get_flight_status": (
        ("What does 'code share' mean for a flight?", "A code share is one flight sold under several airlines' flight numbers."),
        (
            "How early should I get to the airport for an international flight?",
            "About three hours before departure is a safe margin for an international flight.",
        ),
    ),
    "convert_units": (
        ("Why does the US still use miles?", "Mostly habit and cost: road signs, laws and industry were built around miles and never switched."),
        ("What is a kilogram defined by today?", "Since 2019 the kilogram is defined through Planck's constant, not by a metal cylinder."),
    ),
    "find_recipe": (
        ("Why does bread dough need to rest?", "Resting lets the gluten relax and the yeast produce gas, so the bread rises and is easier to shape."),
        ("Is it safe to eat raw cookie dough?", "Not really: raw flour and raw eggs can carry bacteria, so bake it or use a heat-treated dough."),
    ),
    "get_news": (
        ("How can I tell if a news story is reliable?", "Check who published it, whether other outlets confirm it, and whether it names its sources."),
        ("What is the difference between news and opinion pieces?", "News reports what happened; an opinion piece argues a view about it."),
    ),
    "track_package": (
        ("What should I do if a parcel arrives damaged?", "Photograph it, keep the packaging, and report it to the sender or carrier as soon as you can."),
        (
            "Why do tracking numbers have so many digits?",
            "They must be unique across millions of parcels and often encode the carrier, service and a check digit.",
        ),
    ),
    "play_music": (
        ("Why do some songs get stuck in your head?", "Short, repetitive and slightly surprising melodies loop in memory; experts call them earworms."),
        (
            "What is the difference between a major and a minor key?",
            "A minor key lowers the third note of the scale, which most listeners hear as sadder than a major key.",
        ),
    ),
    "get_definition": (
        ("Do you think 'irregardless' is a real word?", "It appears in dictionaries as nonstandard; 'regardless' is the safer choice."),
        ("Give me a sentence using the word 'meander'.", "The river meanders slowly through the valley before reaching the sea."),
    ),
    "set_reminder": (
        ("How can I get better at remembering appointments?", "Write them in one calendar, check it every morning, and set a routine time to plan the week."),
        ("Is it better to study in the morning or at night?", "Whichever time you are most alert; consistency matters more than the hour."),
    ),
    "lookup_contact": (
        (
            "How do I politely ask a colleague for their phone number?",
            "Just ask directly and say why: 'Could I have your number in case I need to reach you about the project?'",
        ),
        ("Should I keep my contacts in my phone or in the cloud?", "Syncing them to a cloud account keeps them safe if the phone is lost."),
    ),
    "get_opening_hours": (
        ("Why do many shops close early on Sundays?", "Many places have laws or traditions limiting Sunday trading, and fewer customers shop then."),
        ("What does 'by appointment only' mean?", "It means you must book a time before you visit; walk-ins are not served."),
    ),
    "search_web": (
        ("Tell me a riddle about a clock.", "What has hands but cannot clap? A clock."),
        ("Write a two-line rhyme about coffee.", "A cup of coffee, dark and deep, chases off the last of sleep."),
    ),
    "check_train_times": (("Why are trains often late in autumn?", "Wet leaves on the rails make wheels slip, so trains must brake earlier and run slower."),),
    "get_air_quality": (
        ("Do houseplants really clean the air?", "Only a little: a room would need far more plants than anyone keeps to make a real difference."),
    ),
    "roll_dice": (("What are the odds of rolling a six on a fair die?", "One in six, about 17 percent."),),
    "create_note": (("What is a good way to organise my notes?", "Group them by project, date each one, and review them weekly."),),
}


def _fill(template: str, values: dict[str, Any]) -> str:
    return template.format(**{k: (", ".join(map(str, v)) if isinstance(v, list) else v) for k, v in values.items()})


class ToolGenerator:
    KINDS = ("tool_call", "tool_none", "tool_calls", "tool_answer", "tool_unavailable")
    WEIGHTS = (4, 3, 1, 2, 2)
    # recipe 4: near misses, and fewer "tool not offered" refusals (recipe 3 over-applied its refusal)
    KINDS_4 = (*KINDS, "tool_near_miss")
    WEIGHTS_4 = (4, 3, 1, 2, 1, 3)

    def __init__(self, rng: random.Random, *, heldout: bool = False, near_misses: bool = False):
        self.rng = rng
        self.heldout = heldout
        self.kinds: tuple[str, ...] = self.KINDS_4 if near_misses else self.KINDS
        self.weights: tuple[int, ...] = self.WEIGHTS_4 if near_misses else self.WEIGHTS
        self.families = [f for f in FAMILIES if (f.name in HELD_OUT_TOOLS) == heldout]
        self.no_tool = NO_TOOL[-1:] if heldout else NO_TOOL[:-1]

    def _request(self, family: ToolFamily) -> tuple[str, dict[str, Any], str]:
        index = len(family.requests) - 1 if self.heldout else self.rng.randrange(len(family.requests) - 1)
        drawn = family.draw(self.rng)
        # in the schema's order: constrained decoding writes an object's properties in that order
        args = {k: drawn[k] for k in family.schema["function"]["parameters"]["properties"] if k in drawn}
        return _fill(family.requests[index], args), args, f"tool:{family.name}:{index}"

    def _offer(self, needed: list[ToolFamily], absent: ToolFamily | None = None) -> list[dict[str, Any]]:
        # other offered tools may come from either split: offering a tool is not asking for it; with a
        # tool absent, no general tool that could still serve the request (web search) is offered
        others = [f for f in FAMILIES if f not in needed and f is not absent and not (absent and f.name in GENERAL_TOOLS)]
        offered = needed + self.rng.sample(others, k=self.rng.randint(max(0, 2 - len(needed)), 4))
        self.rng.shuffle(offered)
        return [{**f.schema, "function": {**f.schema["function"], "name": self.names[f.name]}} for f in offered]

    def example(self) -> Example:
        rng = self.rng
        self.names = {f.name: rng.choice((f.name, f.name, *ALIASES[f.name])) for f in FAMILIES}
        kind = rng.choices(self.kinds, self.weights)[0]
        system = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
        if kind == "tool_near_miss":
            family = rng.choice([f for f in FAMILIES if f.name in NEAR_MISS and (f.name in HELD_OUT_TOOLS) == self.heldout])
            text, reply = rng.choice(NEAR_MISS[family.name])
            return Example(
                kind, [*system, {"role": "user", "content": text}], reply, tools=self._offer([family]), domain="none", template=f"near:{family.name}"
            )
        if kind == "tool_none":
            index = rng.randrange(len(self.no_tool))
            text, reply = self.no_tool[index]
            number = len(NO_TOOL) - 1 if self.heldout else index
            return Example(kind, [*system, {"role": "user", "content": text}], reply, tools=self._offer([]), domain="none", template=f"none:{number}")
        if kind == "tool_calls":
            first, second = rng.sample(self.families, 2)
            (t1, a1, id1), (t2, a2, id2) = self._request(first), self._request(second)
            user = f"{t1} Also, {t2[0].lower()}{t2[1:]}"
            target = format_call(self.names[first.name], a1) + "\n" + format_call(self.names[second.name], a2)
            return Example(
                kind,
                [*system, {"role": "user", "content": user}],
                target,
                tools=self._offer([first, second]),
                domain=f"{first.name}+{second.name}",
                template=f"{id1}+{id2}",
            )
        family = rng.choice(self.families)
        text, args, tid = self._request(family)
        messages: list[dict[str, Any]] = [*system, {"role": "user", "content": text}]
        if kind == "tool_unavailable":  # a request for a tool that is not offered: no call
            return Example(kind, messages, UNAVAILABLE, tools=self._offer([], absent=family), domain="none", template=tid)
        if kind == "tool_call":
            return Example(kind, messages, format_call(self.names[family.name], args), tools=self._offer([family]), domain=family.name, template=tid)
        result = family.result(rng, args)
        from ..tools.calls import dump_json

        messages += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": self.names[family.name], "arguments": dump_json(args)}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": self.names[family.name], "content": dump_json(result)},
        ]
        return Example(kind, messages, _fill(family.reply, {**args, **result}), tools=self._offer([family]), domain=family.name, template=tid)
