"""ddcheck's system under test: a DDTree verify engine in SGLang's layout,
plus the comparison against an oracle and the command line."""
