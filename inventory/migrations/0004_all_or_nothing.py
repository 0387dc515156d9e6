"""`inventory_all_or_nothing(done, parts)`: raise when a sale statement wrote only some rows.

A sale is one statement (`inventory.sale_statement.sell`) that may decrement several rows (stock
shards, then the item). Each decrement has its own guard, so one can pass while another refuses; the
statement then ends with this check, which aborts it, and PostgreSQL undoes every row it wrote.
SQLSTATE FS001 lets the caller tell this refusal from a real error.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION inventory_all_or_nothing(done integer, parts integer)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF done <> 0 AND done <> parts THEN
        RAISE EXCEPTION 'stock write half done: % of % rows', done, parts
            USING ERRCODE = 'FS001';
    END IF;
    RETURN done = parts;
END
$$;
"""

DROP = "DROP FUNCTION IF EXISTS inventory_all_or_nothing(integer, integer);"


class Migration(migrations.Migration):
    dependencies = [("inventory", "0003_sale_opening_and_runs")]

    operations = [migrations.RunSQL(CREATE, DROP)]
