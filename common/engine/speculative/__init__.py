"""Speculative decoding: a proposer guesses tokens, the target model verifies them in one
forward pass (issue 14). ``config`` parses ``--speculative-config``; ``ngram`` proposes from
the request's own context (prompt lookup)."""
