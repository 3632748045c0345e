"""PostgreSQL: the tables, the connection, the embedded server and the migrations."""
