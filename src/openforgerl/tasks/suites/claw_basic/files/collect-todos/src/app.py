import db


def main():
    # TODO: read the port from the environment
    port = 8080
    conn = db.connect()
    # TODO: handle connection errors
    return conn, port
