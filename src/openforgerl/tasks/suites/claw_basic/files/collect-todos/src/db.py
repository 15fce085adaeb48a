def connect():
    # TODO: use a connection pool
    return object()
