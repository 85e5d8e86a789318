"""A short built-in English text: trains the offline demo tokenizer and is the default quality-report stream."""

SAMPLE_TEXT = """\
The history of the city begins with a small market town on the bank of a wide river. Farmers brought grain,
wool and timber to sell, and merchants came from the coast to buy them. Over the years the town grew into a
busy port, with warehouses, workshops and narrow streets that climbed the hill towards the old castle.
In the spring the river rose and flooded the lower streets, so people built their houses on stone walls and
kept their boats tied to the doors. Children learned to swim before they could read, and every family had a
story about the year the water reached the church.
Today the city is known for its university, its museums and its music. Students arrive every autumn from
many countries, and the cafes along the river stay open late into the night. Visitors walk across the old
bridge, look at the painted houses, and climb the tower to see the mountains in the distance.
The weather is mild for most of the year. Summer days are warm and long, and winter brings cold mornings,
fog over the water and, once or twice a year, a little snow. Many people ride bicycles to work, and the
trains to the capital leave every hour from the station near the park.
Scientists at the university study the river, the forests and the birds that nest in the marshes to the
south. They measure the water, count the fish and record how the seasons change. Their work helps the city
plan for floods and protect the wild places that make the region special.
"""
