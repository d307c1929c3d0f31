"""One router per part of the HTTP contract."""
