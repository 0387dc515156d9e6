"""`inventory_sell_batch(requests, at, wait)`: many checkouts' sales in one statement and one commit.

Group commit (`inventory.batch_statement.sell_batch`): the checkouts of one web process's
batch (`inventory.batching`) are written together, each as its own sale with its own guards,
so one refusal never undoes the others. Every request is a JSON object: item, sale, rows ({index: units}), qty, buyer, key,
limit, served_by, fallback. Each gets one result row (its position from 1, the order id or
NULL, the outcome):
- `sold`: its stock rows were decremented (each guarded by `stock >= units`), its allowance
  counted and its order inserted;
- `short`: a stock row held fewer units than asked (Redis granted more than the database holds);
- `restarted`: the sale is no longer the item's current one;
- `duplicate`: its idempotency key is taken (by an earlier order or one earlier in the batch);
- `limit`: the buyer's allowance would pass the sale's per-buyer limit.
Anything but `sold` writes nothing for that request (a subtransaction per request). Rows are
locked in the order the requests name them; the caller locks the batch's stock rows first, by
(sale, index), and sorts the requests by (sale, buyer), so that the batches of several web
processes never wait for each other both ways.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION inventory_sell_batch(requests jsonb, at timestamptz, wait text)
RETURNS TABLE (n integer, order_id bigint, outcome text) LANGUAGE plpgsql AS $$
DECLARE
    request jsonb;
    k integer := 0;
    row_index text;
    units integer;
    current_sale bigint;
    placed bigint;
BEGIN
    -- Bounds every row-lock wait of the batch (the setting ends with its transaction).
    PERFORM set_config('lock_timeout', wait, true);
    FOR request IN SELECT value FROM jsonb_array_elements(requests) LOOP
        k := k + 1;
        n := k;
        order_id := NULL;
        SELECT current_sale_id INTO current_sale
            FROM inventory_item WHERE id = (request->>'item')::bigint;
        IF current_sale IS DISTINCT FROM (request->>'sale')::bigint THEN
            outcome := 'restarted';
            RETURN NEXT;
            CONTINUE;
        END IF;
        BEGIN
            FOR row_index, units IN
                SELECT key, value::integer FROM jsonb_each_text(request->'rows') ORDER BY key::integer
            LOOP
                UPDATE inventory_stockshard SET stock = stock - units, version = version + 1
                    WHERE sale_id = current_sale AND index = row_index::integer AND stock >= units;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'stock row % short' , row_index USING ERRCODE = 'FS002';
                END IF;
            END LOOP;
            IF request->>'limit' IS NOT NULL THEN
                INSERT INTO inventory_buyerallowance (item_id, sale_id, buyer, units, unit_limit)
                    VALUES ((request->>'item')::bigint, current_sale, request->>'buyer',
                            (request->>'qty')::integer, (request->>'limit')::integer)
                    ON CONFLICT (sale_id, buyer)
                    DO UPDATE SET units = inventory_buyerallowance.units + EXCLUDED.units;
            END IF;
            INSERT INTO inventory_order (item_id, sale_id, buyer, qty, status, idempotency_key,
                                         served_by, fallback, shard_units, created_at, updated_at)
                VALUES ((request->>'item')::bigint, current_sale, request->>'buyer',
                        (request->>'qty')::integer, 'pending', request->>'key',
                        request->>'served_by', (request->>'fallback')::boolean, request->'rows',
                        at, at)
                RETURNING id INTO placed;
            order_id := placed;
            outcome := 'sold';
        EXCEPTION
            WHEN SQLSTATE 'FS002' THEN outcome := 'short';
            WHEN unique_violation THEN outcome := 'duplicate';
            WHEN check_violation THEN outcome := 'limit';
        END;
        RETURN NEXT;
    END LOOP;
END
$$;
"""

DROP = "DROP FUNCTION IF EXISTS inventory_sell_batch(jsonb, timestamptz, text);"


class Migration(migrations.Migration):
    dependencies = [("inventory", "0005_stock_rows_per_sale")]

    operations = [migrations.RunSQL(CREATE, DROP)]
