"""Varied English text for benchmark prompts, shipped with the package so workloads are reproducible.

Prompts are built from these sentences (never one token repeated): real text gives a tokenizer
realistic ids and lengths, and a model realistic attention patterns. Written for this project.
"""

from __future__ import annotations

INSTRUCTIONS: tuple[str, ...] = (
    "Summarize the following passage in a few sentences.",
    "Answer the question at the end using the passage.",
    "Continue the text in the same style.",
    "Rewrite the passage for a ten-year-old reader.",
    "List the three most important facts in the passage.",
    "Translate the passage into plain, simple English.",
    "Write a short title for the passage and explain your choice.",
    "Explain what the author is trying to say.",
    "Turn the passage into a numbered list of steps.",
    "Write a reply to the passage as if you were a curious student.",
)

QUESTIONS: tuple[str, ...] = (
    "What is the main idea?",
    "Why does this matter?",
    "What would you do next?",
    "Which detail surprised you most?",
    "How could this be measured?",
    "What is missing from the explanation?",
)

SENTENCES: tuple[str, ...] = (
    # cooking
    "Bread dough rises because yeast eats sugar and releases carbon dioxide into the gluten net.",
    "A pinch of salt in caramel makes the sweetness taste deeper rather than saltier.",
    "Onions cooked slowly over low heat turn brown and sweet as their sugars caramelize.",
    "Fresh pasta needs only flour and eggs, but the dough must rest before it is rolled thin.",
    "Rice absorbs about twice its volume of water when it simmers under a closed lid.",
    "A sharp knife is safer than a dull one because it does not slip off the skin of a tomato.",
    # astronomy
    "Light from the Sun takes a little more than eight minutes to reach the Earth.",
    "Jupiter is so large that more than a thousand Earths would fit inside it.",
    "A comet grows a tail only when it comes close enough to the Sun for its ice to boil away.",
    "The Moon always shows the same face to us because its rotation is locked to its orbit.",
    "Astronomers measure the distance to nearby stars by watching them shift against far ones.",
    "Saturn's rings are made of countless pieces of ice, from grains of dust to house-sized blocks.",
    # history
    "The printing press made books cheap enough that ideas spread across Europe within decades.",
    "Ancient Romans built roads so straight that many modern highways still follow their lines.",
    "The first public libraries lent books to anyone who could read, not only to scholars.",
    "Sailors once navigated by the stars, measuring the angle of Polaris above the horizon.",
    "Canals carried coal and grain long before railways crossed the same valleys.",
    "Old maps often filled unknown regions with drawings of sea monsters and strange beasts.",
    # programming
    "A hash table finds a key in constant time on average by turning the key into an index.",
    "Unit tests catch a regression the moment a change breaks behaviour that used to work.",
    "A queue hands out work in the order it arrived, while a stack returns the newest item first.",
    "Caching trades memory for speed by keeping the answers to questions asked before.",
    "A race condition appears when two threads change the same value without taking turns.",
    "Good variable names make a function readable long after its author has forgotten it.",
    "Batching many small requests into one large call lets hardware do more work per trip.",
    # gardening
    "Tomatoes grow best in full sun and need deep watering rather than a daily sprinkle.",
    "Compost turns kitchen scraps into dark soil that holds water and feeds the roots.",
    "Bees visit the flowers of squash in the early morning, before the blossoms close.",
    "Pruning an apple tree in late winter lets light reach the fruit in summer.",
    "Mulch keeps weeds down and stops the soil from drying out on hot afternoons.",
    # finance
    "Compound interest means that the interest itself earns interest the following year.",
    "A budget works best when it tracks what was actually spent, not what was planned.",
    "Paying a fixed cost for idle machines is one of the quietest ways a company loses money.",
    "Diversifying savings across many assets lowers the risk that one failure ruins everything.",
    "Inflation slowly reduces what the same banknote can buy at the market.",
    # sports and health
    "Marathon runners train their bodies to burn fat so they do not run out of stored sugar.",
    "A good warm-up raises the temperature of muscles and makes injuries less likely.",
    "Swimmers breathe to both sides so their stroke stays balanced over long distances.",
    "Sleep is when the body repairs muscle and the brain sorts the memories of the day.",
    "Drinking water before feeling thirsty helps during long hikes in the summer heat.",
    # travel and geography
    "The Nile flows north, carrying silt that made its valley one of the richest farmlands.",
    "Mountain weather changes quickly, so hikers carry a warm layer even on sunny mornings.",
    "Night trains let travellers cross a country while they sleep and wake in a new city.",
    "Deserts can freeze at night because dry air lets the day's heat escape into space.",
    "Many islands in the Pacific were settled by sailors who read the swell of the ocean.",
    # biology and nature
    "Octopuses can change the colour and texture of their skin in a fraction of a second.",
    "Trees in a forest share water and sugar with each other through networks of fungi.",
    "Migrating birds use the Earth's magnetic field to keep their course across the sea.",
    "A hummingbird's heart can beat more than a thousand times a minute in flight.",
    "Coral reefs are built by tiny animals that lay down skeletons of limestone over centuries.",
    "Whales sing songs that change slowly from year to year across an entire ocean.",
    # music and art
    "A violin string vibrates in many parts at once, which gives the instrument its rich tone.",
    "Painters mix a little of the sky's colour into every shadow to make a landscape cohere.",
    "Jazz musicians improvise over a fixed sequence of chords that everyone in the band knows.",
    "A choir sounds in tune when each singer listens to the others more than to themselves.",
    "Photographers often prefer the soft light of the hour just after sunrise.",
    # everyday science
    "Ice floats because water expands as it freezes into an open crystal lattice.",
    "A bicycle stays upright at speed partly because the front wheel steers into any lean.",
    "Metal feels colder than wood at the same temperature because it carries heat away faster.",
    "Rainbows appear when sunlight is bent and split by millions of falling droplets.",
    "Sound travels about four times faster through water than through air.",
    "A pressure cooker raises the boiling point of water so food cooks in less time.",
    # work and organisation
    "Meetings end on time when someone writes down the decisions before anyone leaves.",
    "A restaurant kitchen seats new guests as soon as a table clears, not when the room empties.",
    "Waiting for the slowest member of a group wastes the time of everyone who is already done.",
    "A checkout line moves faster when a new cashier opens the moment one becomes free.",
    "Clear labels on shelves save a warehouse hours of searching every week.",
)
