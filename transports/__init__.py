"""How bytes move: each module is one transport behind the small interface in ``transports.base``."""
