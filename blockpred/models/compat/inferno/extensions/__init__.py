"""``inferno.extensions``: the layers published models import (:mod:`.layers`)."""
